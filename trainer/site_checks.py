"""Site checks of the node doctor: whether every node gives what the run's site profile asks
of it, and, where one does not, the change to the profile (or the node) that fixes it.

The doctor program (trainer.doctor) reads the facts on each node (the interface that routes to
the rendezvous host, the node's IPv4 addresses, its InfiniBand ports, the snapshot tmpfs,
whether it sees the files the head node wrote, which modules its Python finds) and gathers
them to rank 0. This module is the pure part: it reads the text of ``ip -o route get``,
``ip -o -4 addr`` and ``/proc/net/route``, says what the site needs (:func:`site_needs`),
judges each node's facts into a :class:`Check` (ok, what was found, the fix naming the profile
key) and merges the nodes with the same result into one entry of doctor.json's
``site_checks`` (:func:`merge`). Nothing here runs a command or touches a file.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jobgen.spec.resolved import ResolvedSpec

GIB = 1024**3
MIN_SNAPSHOT_BYTES = GIB  # a tmpfs below this holds no model's snapshot: a container's 64 MiB default
# Route types `ip route get` may print before the address; a line without one is a unicast route.
ROUTE_KINDS = ("local", "broadcast", "multicast", "anycast", "unreachable", "blackhole", "prohibit", "throw", "nat")
SHARED_FIX = "{key} must be one filesystem every node sees (a node-local directory is not shared)"
# What a node found where the head node wrote its file (NodeFacts.seen), in words.
SEEN_WORDS = {
    "missing": "the file the head node wrote there is not there",
    "other": "a file of that name holds another token than the head node wrote",
    "no directory": "no such directory on this node",
    "link": "a link stands where the head node wrote a file",
}


class SiteFactError(ValueError):
    """Text from a command or a /proc file that does not say what it should (``ip route get``
    without ``dev``): the fact is recorded as unreadable, with this message."""


class Iface(NamedTuple):
    """One IPv4 address of a network interface: ``eth0 10.0.0.2/24``."""

    name: str
    addr: str
    prefix: int


class Route(NamedTuple):
    """What ``ip route get ADDR`` says of one address: the route's type (``unicast``, ``local``
    for an address of this node), the interface it leaves by and the source address, if given."""

    kind: str
    dev: str
    src: str | None


class ProcRoute(NamedTuple):
    """One line of /proc/net/route: the interface, and the destination network and its mask as
    IPv4 addresses."""

    dev: str
    dest: str
    mask: str


class Probe(NamedTuple):
    """A file the head node wrote into a directory every node must see as one filesystem: the
    profile key that names the directory, the directory, the file's name and the token it holds.
    Without a file, ``skipped`` says why that is no fault (the directory does not exist yet), or
    ``problem`` why the head node could not write one."""

    key: str
    directory: str
    name: str | None = None
    token: str | None = None
    skipped: str | None = None
    problem: str | None = None


@dataclass(frozen=True)
class SiteNeeds:
    """What the run's site profile asks of every node, as rank 0 read it from spec.json."""

    ifname: str | None
    transport: str
    ib_hca: str | None
    snapshot_dir: str
    shared: tuple[tuple[str, str], ...]  # (profile key, directory) that every node must see as one
    imports: tuple[tuple[str, str], ...]  # (jobgen extra, module) a training run on the site imports


@dataclass(frozen=True)
class SitePlan:
    """What rank 0 hands every rank before the site checks: the needs and the files it wrote,
    or why there are no site checks (``skipped``: no spec.json, a doctor started by hand)."""

    needs: SiteNeeds | None = None
    probes: tuple[Probe, ...] = ()
    skipped: str | None = None


@dataclass
class NodeFacts:
    """What one node's local rank 0 read about its node for the site checks. ``errors`` holds,
    by fact (``route``, ``interfaces``...), why a fact could not be read."""

    node: str
    rendezvous: str | None = None  # MASTER_ADDR as torchrun set it
    rendezvous_addr: str | None = None  # its IPv4 address, as this node resolves it
    route: Route | None = None
    interfaces: list[Iface] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # every interface's name, with or without IPv4
    infiniband: list[tuple[str, list[str]]] = field(default_factory=list)  # (device, port states)
    shm_is_dir: bool = False
    shm_size: int = 0
    shm_free: int = 0
    seen: dict[str, str] = field(default_factory=dict)  # probe key -> "seen" or a key of SEEN_WORDS
    missing: list[str] = field(default_factory=list)  # modules the node's Python does not find
    prefix: str = ""  # that Python's sys.prefix
    errors: dict[str, str] = field(default_factory=dict)


class Check(NamedTuple):
    """One site check's result on one node; ``fix`` (when not ok) names the profile key."""

    name: str
    node: str
    ok: bool
    found: str
    fix: str | None = None


# --------------------------------------------------------------------------- reading text


def parse_route_get(text: str) -> Route:
    """The route in the output of ``ip -o route get ADDR`` (its first line)."""
    words = (text.strip().splitlines() or [""])[0].split()
    kind = words[0] if words and words[0] in ROUTE_KINDS else "unicast"
    after: dict[str, str] = {}
    for key, value in itertools.pairwise(words):
        if key in ("dev", "src"):
            after.setdefault(key, value)
    if "dev" not in after:
        raise SiteFactError(f"no interface (dev) in `ip route get`: {text.strip()[:200]!r}")
    return Route(kind, after["dev"], after.get("src"))


_ADDR_LINE = re.compile(r"^\d+:\s+(\S+)\s+inet\s+(\d{1,3}(?:\.\d{1,3}){3})(?:/(\d{1,2}))?")


def parse_addrs(text: str) -> list[Iface]:
    """Every IPv4 address in the output of ``ip -o -4 addr``, with its interface."""
    found = []
    for line in text.splitlines():
        match = _ADDR_LINE.match(line.strip())
        if match:
            name, addr, prefix = match.groups()
            # A veth shows as eth0@if12; NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME name it eth0.
            found.append(Iface(name.split("@")[0], addr, int(prefix or 32)))
    return found


def _hex_addr(text: str) -> str:
    # /proc/net/route prints each address as the host-order integer of its network-order bytes.
    return str(ipaddress.IPv4Address(struct.pack("=I", int(text, 16))))


def parse_proc_route(text: str) -> list[ProcRoute]:
    """The routes that are up in /proc/net/route (its header line skipped)."""
    routes = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            if int(fields[3], 16) & 0x1:  # RTF_UP
                routes.append(ProcRoute(fields[0], _hex_addr(fields[1]), _hex_addr(fields[7])))
        except ValueError as exc:
            raise SiteFactError(f"unreadable line in /proc/net/route: {line.strip()[:200]!r}") from exc
    return routes


def route_by_table(addr: str, routes: list[ProcRoute], interfaces: list[Iface]) -> Route:
    """The route to ``addr`` without the ``ip`` command: an address of this node is local,
    else the longest prefix of /proc/net/route that holds it."""
    target = ipaddress.IPv4Address(addr)
    if target.is_loopback:
        return Route("local", "lo", addr)
    owner = next((i.name for i in interfaces if i.addr == addr), None)
    if owner is not None:
        return Route("local", owner, addr)
    best: tuple[int, str] | None = None
    for route in routes:
        network = ipaddress.IPv4Network(f"{route.dest}/{route.mask}", strict=False)
        if target in network and (best is None or network.prefixlen > best[0]):
            best = (network.prefixlen, route.dev)
    if best is None:
        raise SiteFactError(f"no route to {addr} in /proc/net/route")
    return Route("unicast", best[1], None)


def port_state(text: str) -> str:
    """An InfiniBand port's state from its sysfs ``state`` file: ``4: ACTIVE`` -> ``ACTIVE``."""
    return text.strip().split(":", 1)[-1].strip() or "unknown"


def hca_names(ib_hca: str) -> tuple[bool, list[str]] | None:
    """The devices an NCCL_IB_HCA value names, and whether exactly (``=mlx5_0``) rather than by
    prefix; None for an exclusion list (``^mlx5_2``), which names no device it needs."""
    if ib_hca.startswith("^"):
        return None
    exact = ib_hca.startswith("=")
    return exact, [part.split(":")[0] for part in ib_hca.lstrip("=").split(",") if part]


# --------------------------------------------------------------------------- what the site needs


def site_needs(spec: ResolvedSpec, run_dir: Path) -> SiteNeeds:
    """What ``spec``'s site asks of every node. The doctor's run directory stands for the runs
    root (it is inside it); the modules are those a training run of the same spec imports."""
    from jobgen.launch.environment import required_imports
    from jobgen.program.kinds import PROGRAMS

    paths, network = spec.site.paths, spec.site.network
    runs_key = "job.runs_root" if spec.run.job.runs_root else "paths.runs_root"
    shared = [(runs_key, str(run_dir)), ("paths.data_cache", paths.data_cache), ("paths.hf_home", paths.hf_home)]
    if spec.run.job.runs_root and str(spec.run.job.runs_root) != str(paths.runs_root):
        # A doctor whose own run lives elsewhere checks the site's runs root as it checks a cache:
        # where the site's is node-local, a run there could not even write its batch log.
        shared.insert(1, ("paths.runs_root", paths.runs_root))
    # The trainer's own entry, found by what it does, not by its name (the program table rules).
    trainer = next(entry.name for entry in PROGRAMS.values() if entry.trains)
    job = spec.run.job.model_copy(update={"program": trainer})
    as_training = dataclasses.replace(spec, run=spec.run.model_copy(update={"job": job}))
    return SiteNeeds(
        ifname=network.ifname,
        transport=network.transport,
        ib_hca=network.ib_hca,
        snapshot_dir=paths.snapshot_dir,
        shared=tuple((key, value) for key, value in shared if value),
        imports=tuple(dict.fromkeys(required_imports(as_training))),
    )


# --------------------------------------------------------------------------- judging one node


def route_device(facts: NodeFacts, peers: list[NodeFacts]) -> tuple[str | None, str]:
    """The interface ``facts``' node reaches the rendezvous host over, and how that was found,
    in words. The head node reaches itself locally: its interface is the one holding the
    address, or, where its name is a loopback one, the one in the network the others come from."""
    addr = facts.rendezvous_addr
    if addr is None:
        why = facts.errors.get("rendezvous", "MASTER_ADDR is not set")
        return None, f"the rendezvous host {facts.rendezvous or '?'} has no IPv4 address here ({why})"
    if facts.route is None:
        return None, f"no route to the rendezvous host {addr} ({facts.errors.get('route', 'not read')})"
    dev = facts.route.dev
    if facts.route.kind == "local":
        dev = next((i.name for i in facts.interfaces if i.addr == addr), None)
    if dev is not None and not ipaddress.IPv4Address(addr).is_loopback:
        return dev, f"the rendezvous host {addr} is reached over {dev}"
    sources = [p.route.src for p in peers if p.route is not None and p.route.kind != "local" and p.route.src]
    for iface in facts.interfaces:
        network = ipaddress.IPv4Network(f"{iface.addr}/{iface.prefix}", strict=False)
        if not ipaddress.IPv4Address(iface.addr).is_loopback and any(
            ipaddress.IPv4Address(s) in network for s in sources
        ):
            return iface.name, f"the other nodes reach this node (the rendezvous host) over {iface.name}"
    return None, f"the rendezvous host is this node, by a loopback address ({addr})"


def _addresses(facts: NodeFacts) -> str:
    listed = [f"{i.name} {i.addr}" for i in facts.interfaces if not ipaddress.IPv4Address(i.addr).is_loopback]
    return ", ".join(listed) or "none"


def judge_ifname(needs: SiteNeeds, facts: NodeFacts, peers: list[NodeFacts]) -> Check:
    """network.ifname: set, and an interface of this node with an IPv4 address."""
    dev, how = route_device(facts, peers)
    name = "network.ifname"
    if needs.ifname is None:
        # Without a route to another node (one node, reached by a loopback name) the candidates are named.
        fix = f'network.ifname = "{dev}"' if dev else f"network.ifname: one of {_addresses(facts)} (the nodes' network)"
        return Check(name, facts.node, False, f"not set; {how}", fix)
    if needs.ifname in {i.name for i in facts.interfaces}:
        found = f"{needs.ifname} has an IPv4 address; {how}"
        return Check(name, facts.node, True, found)
    state = "has no IPv4 address" if needs.ifname in facts.links else "is no interface of this node"
    found = f"{needs.ifname} {state} (IPv4: {_addresses(facts)}); {how}"
    fix = f'network.ifname = "{dev}"' if dev else f"network.ifname: one of {_addresses(facts)}"
    return Check(name, facts.node, False, found, fix)


def judge_transport(needs: SiteNeeds, facts: NodeFacts) -> Check:
    """network.transport (and ib_hca) against the node's InfiniBand devices and their ports."""
    name, node = "network.transport", facts.node
    if "infiniband" in facts.errors:
        found = f"InfiniBand devices unreadable: {facts.errors['infiniband']}"
        if needs.transport != "ib":
            return Check(name, node, True, found)
        return Check(name, node, False, found, 'network.transport = "socket", unless the nodes have InfiniBand')
    devices = [dev for dev, _ in facts.infiniband]
    active = [dev for dev, states in facts.infiniband if "ACTIVE" in states]
    listed = ", ".join(f"{dev} ({'/'.join(states) or 'no ports'})" for dev, states in facts.infiniband)
    if needs.transport != "ib":
        if active:
            found = f'InfiniBand devices {" ".join(active)} found: transport = "ib" (and ib_hca) would use them'
            return Check(name, node, True, found)
        return Check(name, node, True, f"socket; InfiniBand: {listed or 'none'}")
    if not devices:
        return Check(name, node, False, "ib, but no InfiniBand devices", 'network.transport = "socket"')
    if not active:
        return Check(name, node, False, f"ib, but no port is ACTIVE: {listed}", 'network.transport = "socket"')
    named = hca_names(needs.ib_hca) if needs.ib_hca else None
    if named is not None:
        exact, wanted = named
        absent = [w for w in wanted if not any(d == w if exact else d.startswith(w) for d in active)]
        if absent:
            found = f"network.ib_hca names {', '.join(absent)}, not an active device here ({listed})"
            return Check(name, node, False, found, f'network.ib_hca = "{",".join(active)}"')
    return Check(name, node, True, f"ib over {listed}")


def judge_snapshot_dir(needs: SiteNeeds, facts: NodeFacts) -> Check:
    """paths.snapshot_dir: a directory of at least 1 GiB (a node-local tmpfs, /dev/shm)."""
    name, where = "paths.snapshot_dir", needs.snapshot_dir
    fix = f"paths.snapshot_dir: a node-local tmpfs of {MIN_SNAPSHOT_BYTES // GIB} GiB or more"
    if "shm" in facts.errors:
        return Check(name, facts.node, False, f"{where}: {facts.errors['shm']}", fix)
    if not facts.shm_is_dir:
        return Check(name, facts.node, False, f"{where} is not a directory", fix)
    found = f"{where}: {gib(facts.shm_size)} ({gib(facts.shm_free)} free)"
    if facts.shm_size < MIN_SNAPSHOT_BYTES:
        return Check(name, facts.node, False, found, fix)
    return Check(name, facts.node, True, found)


def gib(size: int) -> str:
    """Bytes in GiB, to a tenth below 10 GiB, whole above: alike nodes read alike."""
    value = size / GIB
    return f"{value:.1f} GiB" if value < 10 else f"{value:.0f} GiB"


def judge_shared(probe: Probe, facts: NodeFacts) -> Check:
    """One directory every node must see as one filesystem: whether this node read the head
    node's file back."""
    if probe.skipped is not None:
        return Check(probe.key, facts.node, True, f"{probe.directory}: {probe.skipped}")
    if probe.problem is not None:
        fix = f"{probe.key}: a directory you may write, on every node"
        return Check(probe.key, facts.node, False, f"{probe.directory}: {probe.problem}", fix)
    fix = SHARED_FIX.format(key=probe.key)
    seen = facts.seen.get(probe.key, "not read")
    if seen == "seen":
        return Check(probe.key, facts.node, True, f"{probe.directory}: the head node's file is seen")
    words = SEEN_WORDS.get(seen, seen)
    return Check(probe.key, facts.node, False, f"{probe.directory}: {words}", fix)


def judge_environment(needs: SiteNeeds, facts: NodeFacts) -> Check:
    """The modules a training run imports, in the Python the nodes run (sys.prefix)."""
    name = "environment"
    if "environment" in facts.errors:
        return Check(name, facts.node, False, facts.errors["environment"], "see the doctor's log")
    if not facts.missing:
        modules = ", ".join(module for _, module in needs.imports)
        return Check(name, facts.node, True, f"{facts.prefix} has {modules}")
    extras = dict.fromkeys(extra for extra, module in needs.imports if module in facts.missing)
    fix = "; ".join(f"pip install 'jobgen[{extra}]' into {facts.prefix} on the node" for extra in extras)
    return Check(name, facts.node, False, f"{facts.prefix} lacks {', '.join(facts.missing)}", fix)


def judge(plan: SitePlan, everyone: list[NodeFacts]) -> list[Check]:
    """Every site check on every node, check by check."""
    needs = plan.needs
    if needs is None:
        return []
    checks = []
    for facts in everyone:
        if "site checks" in facts.errors:  # the facts could not be gathered at all
            checks.append(Check("site checks", facts.node, False, facts.errors["site checks"], "see the doctor's log"))
            continue
        peers = [p for p in everyone if p.node != facts.node]
        checks += [
            judge_ifname(needs, facts, peers),
            judge_transport(needs, facts),
            judge_snapshot_dir(needs, facts),
            *(judge_shared(probe, facts) for probe in plan.probes),
            judge_environment(needs, facts),
        ]
    order = list(dict.fromkeys(check.name for check in checks))
    return sorted(checks, key=lambda check: order.index(check.name))


def merge(checks: list[Check]) -> list[dict[str, object]]:
    """doctor.json's ``site_checks``: one entry per check and result, naming every node that
    gave it (in the order the checks were made; a check's results in the order of its first node)."""
    groups: dict[tuple[str, bool, str, str | None], list[str]] = {}
    for check in checks:
        groups.setdefault((check.name, check.ok, check.found, check.fix), []).append(check.node)
    return [
        {"check": name, "nodes": nodes, "ok": ok, "found": found, "fix": fix}
        for (name, ok, found, fix), nodes in groups.items()
    ]
