"""Give every dev-cluster node its own network stack (``jobgen cluster up --netns``).

Layout, for nodes node1..nodeN::

    host: bridge jgbr0 10.213.47.1/24 ── veth jgv1 ── netns jgnode1: eth0 10.213.47.11/24, lo
                                       └─ veth jgv2 ── netns jgnode2: eth0 10.213.47.12/24, lo

The namespaces get no default route and the host forwards nothing for them, so
traffic stays between the nodes and the host.  Each step is idempotent and is
reported to a callback as soon as it exists, so a killed ``up`` still leaves a
record that ``down`` can undo.

By hand, one node's stack is::

    nsenter --net=/run/netns/jgnode1 ip -4 -o addr show eth0
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .state import ClusterError

BRIDGE = "jgbr0"  # instance 0's (jobgen.devcluster.instances names every instance's)
NETNS_DIR = Path("/run/netns")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARKER = "jobgen-cluster"  # instance 0's block; "# BEGIN <marker>" ... "# END <marker>"
# Private /24s tried in order; the first that no route on this machine touches wins.
CANDIDATE_SUBNETS = ("10.213.47.0/24", "10.213.147.0/24", "172.31.213.0/24", "192.168.213.0/24")
NODE_HOST_OFFSET = 10  # nodeK gets .(10+K)
MNT_DETACH = 2


@dataclass(frozen=True)
class NetPlan:
    """Addresses for one cluster: the bridge (controller) and each node."""

    subnet: str
    bridge_addr: str
    node_addrs: dict[str, str]

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen


def ns_name(node: str) -> str:
    return f"jg{node}"  # node1 -> jgnode1


def ns_path(node: str) -> str:
    return str(NETNS_DIR / ns_name(node))


def veth_name(node: str) -> str:
    return f"jgv{node.removeprefix('node')}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _link_exists(name: str, netns: str | None = None) -> bool:
    args = (["-n", netns] if netns else []) + ["link", "show", "dev", name]
    return _ip(*args, check=False).returncode == 0


def _routes_in_use(bridge: str) -> list[ipaddress.IPv4Network]:
    """Destinations of every IPv4 route (all tables) except default routes and
    those of our own bridge (left by a killed `up`, about to be reused)."""
    nets = []
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        parts = line.split()
        if f"dev {bridge}" in f" {line} ":
            continue
        # `table all` prefixes some routes with their type ("local 127.0.0.0/8 ...").
        if parts and parts[0] in ("broadcast", "local", "unreachable", "blackhole", "prohibit", "unicast"):
            parts = parts[1:]
        if not parts or parts[0] == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(parts[0], strict=False))
        except ValueError:
            continue
    return nets


def plan(nodes: list[str], bridge: str = BRIDGE) -> NetPlan:
    """Choose a private /24 that no route on this machine overlaps (another dev cluster's
    bridge has one: each cluster gets its own)."""
    if len(nodes) > 200:
        raise ClusterError("netns mode supports at most 200 nodes")
    in_use = _routes_in_use(bridge)
    for candidate in CANDIDATE_SUBNETS:
        net = ipaddress.ip_network(candidate)
        if any(net.overlaps(used) for used in in_use):
            continue
        hosts = list(net.hosts())
        return NetPlan(
            subnet=str(net),
            bridge_addr=str(hosts[0]),
            node_addrs={n: str(net.network_address + NODE_HOST_OFFSET + i + 1) for i, n in enumerate(nodes)},
        )
    raise ClusterError(f"all candidate subnets {CANDIDATE_SUBNETS} are in use on this machine")


def _bridge_subnet(bridge: str) -> str | None:
    """The subnet already on our bridge (a stale one from a killed `up`), if any."""
    proc = _ip("-4", "-o", "addr", "show", "dev", bridge, check=False)
    for line in proc.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            return str(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return None


def create(net: NetPlan, record: Callable[[str, str], None], bridge: str = BRIDGE) -> None:
    """Build the bridge, namespaces and veths; ``record(kind, name)`` after each one.

    kinds: "netns_dir", "bridge", "netns", "veth".
    """
    # Pieces with our names that already exist are leftovers of a killed
    # `up` whose record is gone: they are reused and recorded as ours.
    if not NETNS_DIR.exists():
        # `ip netns add` would create it; note it so `down` removes it again.
        NETNS_DIR.mkdir(parents=True)
        record("netns_dir", str(NETNS_DIR))
    elif all(entry.name.startswith("jgnode") for entry in NETNS_DIR.iterdir()):
        record("netns_dir", str(NETNS_DIR))

    if not _link_exists(bridge):
        _ip("link", "add", bridge, "type", "bridge")
    record("bridge", bridge)
    bridge_cidr = f"{net.bridge_addr}/{net.prefixlen}"
    if _bridge_subnet(bridge) != net.subnet:
        _ip("addr", "flush", "dev", bridge)
        _ip("addr", "add", bridge_cidr, "dev", bridge)
    _ip("link", "set", bridge, "up")

    for node, addr in net.node_addrs.items():
        ns, veth, peer = ns_name(node), veth_name(node), f"{veth_name(node)}p"
        if not os.path.exists(ns_path(node)):
            _ip("netns", "add", ns)
        record("netns", ns)
        if not _link_exists(veth):
            # Created with a temporary name, then moved and renamed, because
            # the name eth0 is already taken in the host namespace.
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            record("veth", veth)
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "link", "set", peer, "name", "eth0")
        record("veth", veth)
        if _link_exists("eth0", ns):
            _ip("-n", ns, "addr", "flush", "dev", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        else:
            raise ClusterError(f"namespace {ns} has no eth0 although {veth} exists; run `jobgen cluster down`")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", veth, "master", bridge, "up")


def destroy(*, namespaces: list[str], veths: list[str], bridge: str | None, netns_dir: bool) -> list[str]:
    """Remove what ``create`` made; return error lines instead of stopping half way."""
    errors = []
    for veth in veths:
        # Deleting one end deletes the pair, wherever the peer is.
        if _link_exists(veth):
            proc = _ip("link", "del", veth, check=False)
            if proc.returncode:
                errors.append(f"ip link del {veth}: {proc.stderr.strip()}")
    for ns in namespaces:
        if (NETNS_DIR / ns).exists():
            proc = _ip("netns", "del", ns, check=False)
            if proc.returncode:
                errors.append(f"ip netns del {ns}: {proc.stderr.strip()}")
    if bridge and _link_exists(bridge):
        proc = _ip("link", "del", bridge, check=False)
        if proc.returncode:
            errors.append(f"ip link del {bridge}: {proc.stderr.strip()}")
    if netns_dir and NETNS_DIR.is_dir() and not any(NETNS_DIR.iterdir()):
        # `ip netns add` bind-mounts /run/netns onto itself (to make it a
        # shared mount); undo that before removing the directory.
        for _ in range(5):
            if not _is_mountpoint(NETNS_DIR) or not _umount(NETNS_DIR):
                break
        try:
            NETNS_DIR.rmdir()
        except OSError as exc:
            errors.append(f"rmdir {NETNS_DIR}: {exc}")
    return errors


def _is_mountpoint(path: Path) -> bool:
    # Not os.path.ismount: a bind mount of the same filesystem has the same
    # st_dev as its parent, so ismount() says False for /run/netns.
    try:
        with open("/proc/self/mountinfo") as fh:
            return any(line.split()[4] == str(path) for line in fh)
    except OSError:
        return False


def _umount(path: Path) -> bool:
    # The syscall, not umount(8): util-linux would leave /run/mount/utab behind.
    # MNT_DETACH as a fallback: right after `ip netns del` the mount can still
    # be busy for a moment.
    libc = ctypes.CDLL(None, use_errno=True)
    return any(libc.umount2(str(path).encode(), flags) == 0 for flags in (0, MNT_DETACH))


def hosts_block(node_addrs: dict[str, str], marker: str = HOSTS_MARKER) -> str:
    lines = [f"# BEGIN {marker}"] + [f"{addr}\t{node}" for node, addr in node_addrs.items()] + [f"# END {marker}"]
    return "\n".join(lines) + "\n"


def _strip_block(text: str, marker: str) -> str:
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == f"# BEGIN {marker}":
            inside = True
            continue
        if stripped == f"# END {marker}":
            inside = False
            continue
        if not inside:
            out.append(line)
    return "".join(out)


def _write_in_place(path: Path, text: str) -> None:
    # In place, not temp + rename: /etc/hosts is often a bind mount in
    # containers, and renaming over a mount point fails with EBUSY.
    with open(path, "r+") as fh:
        fh.seek(0)
        fh.write(text)
        fh.truncate()


def add_hosts(node_addrs: dict[str, str], marker: str = HOSTS_MARKER, hosts_file: Path = HOSTS_FILE) -> None:
    """Put the node names between our markers in /etc/hosts (replacing an old block)."""
    text = _strip_block(hosts_file.read_text(), marker)
    if text and not text.endswith("\n"):
        text += "\n"
    _write_in_place(hosts_file, text + hosts_block(node_addrs, marker))


def remove_hosts(marker: str = HOSTS_MARKER, hosts_file: Path = HOSTS_FILE) -> None:
    if not hosts_file.exists():
        return
    text = hosts_file.read_text()
    if f"# BEGIN {marker}" in text:
        _write_in_place(hosts_file, _strip_block(text, marker))
