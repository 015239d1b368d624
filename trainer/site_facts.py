"""What one node has that its site profile relies on, read on the node itself for the doctor's
site checks (trainer.site_checks judges it, trainer.doctor gathers it to rank 0).

Two sides. The head node's rank 0 reads the run's spec.json and writes a file holding a fresh
token into each directory every node must see as one filesystem (:func:`plan_site_checks`),
and removes them once every node has looked (:func:`remove_probes`). Each node's local rank 0
reads its facts (:func:`read_node`): the route and interface to the rendezvous host (``ip``,
else /proc/net/route and ioctl), the InfiniBand ports in sysfs, the snapshot tmpfs's size,
whether it finds the head node's files, and which of the run's modules its Python finds.
A fact that cannot be read is recorded with why (``NodeFacts.errors``), never raised.

The probe files are made with O_EXCL | O_NOFOLLOW and read with O_NOFOLLOW | O_NONBLOCK,
relative to the directory's descriptor: a link or a pipe someone put at the name in a shared
directory (a group's data cache) is never followed, overwritten or waited on.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import ipaddress
import os
import secrets
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from trainer.site_checks import (
    Iface,
    NodeFacts,
    Probe,
    SiteFactError,
    SitePlan,
    parse_addrs,
    parse_proc_route,
    parse_route_get,
    port_state,
    route_by_table,
    site_needs,
)

PROBE_PREFIX = ".jobgen-doctor-"
SIOCGIFADDR, SIOCGIFNETMASK = 0x8915, 0x891B  # linux/sockios.h
IP_TIMEOUT_SECONDS = 10
PROBE_WAITS = (0.0, 1.0, 2.0)  # seconds before each look for the head node's file
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Never follow a link or open a pipe planted where the probe file goes (a group's data cache).
_OPEN_PROBE = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def plan_site_checks(run_dir: Path) -> tuple[SitePlan, list[tuple[int, str]]]:
    """Rank 0: what the site in ``run_dir``'s spec.json needs, with a file of a fresh token in
    each directory every node must share, and those files' (directory fd, name) to remove."""
    # Here, not at the top: the doctor itself needs only torch and jobgen.base (pydantic reads the spec).
    from jobgen.spec.spec_json import read_spec

    try:
        needs = site_needs(read_spec(run_dir / "spec.json"), run_dir)
    except FileNotFoundError:
        return SitePlan(skipped=f"no spec.json in {run_dir} (a doctor started by hand)"), []
    except (OSError, ValueError) as exc:  # DamagedFile is a ValueError
        return SitePlan(skipped=f"spec.json unreadable: {exc}"), []
    placed = [place_probe(key, directory) for key, directory in needs.shared]
    return SitePlan(needs, tuple(probe for probe, _ in placed)), [held for _, held in placed if held]


def place_probe(key: str, directory: str) -> tuple[Probe, tuple[int, str] | None]:
    """A new file holding a fresh token in ``directory`` (O_EXCL | O_NOFOLLOW: nothing there is
    followed or overwritten), and its (directory fd, name) for :func:`remove_probes`."""
    try:
        dir_fd = os.open(os.path.expanduser(directory), _OPEN_DIR)
    except FileNotFoundError:
        return Probe(key, directory, skipped="does not exist on the head node yet: not checked"), None
    except OSError as exc:
        return Probe(key, directory, problem=f"the head node cannot open it ({exc.strerror})"), None
    name, token = PROBE_PREFIX + secrets.token_hex(8), secrets.token_hex(16)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_PROBE, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        os.close(dir_fd)
        return Probe(key, directory, problem=f"the head node cannot write a file there ({exc.strerror})"), None
    problem: str | None = None
    try:
        os.write(fd, token.encode())
        os.fsync(fd)  # on the server before any node looks
    except OSError as exc:
        problem = f"the head node cannot write a file there ({exc.strerror})"
    finally:
        os.close(fd)
    if problem is not None:
        return Probe(key, directory, problem=problem), (dir_fd, name)
    return Probe(key, directory, name, token), (dir_fd, name)


def remove_probes(held: list[tuple[int, str]]) -> None:
    """Rank 0: the probe files gone, by name in the directory each was made in, and their
    directories' descriptors closed."""
    for dir_fd, name in held:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass  # already gone; the name is random, nothing else can be there
        os.close(dir_fd)


def read_probe(probe: Probe) -> str:
    """What this node finds where the head node wrote ``probe``: "seen", or a key of
    trainer.site_checks.SEEN_WORDS, or the error in words."""
    try:
        dir_fd = os.open(os.path.expanduser(probe.directory), _OPEN_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return "no directory"
    except OSError as exc:
        return f"cannot open the directory ({exc.strerror})"
    try:
        for wait in PROBE_WAITS:
            time.sleep(wait)  # a lazily consistent shared filesystem may show a new file late
            try:
                fd = os.open(str(probe.name), os.O_RDONLY | _OPEN_PROBE, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                return "link" if exc.errno == errno.ELOOP else f"cannot read the file ({exc.strerror})"
            try:
                data = os.read(fd, 256) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
            finally:
                os.close(fd)
            return "seen" if data.decode(errors="replace") == probe.token else "other"
        return "missing"
    finally:
        os.close(dir_fd)


def run_ip(*args: str) -> str | None:
    """The output of ``ip ARGS``; None where there is no ``ip`` command."""
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_SECONDS, check=False)
    except FileNotFoundError:
        return None
    if proc.returncode != 0:
        raise SiteFactError(f"ip {' '.join(args)}: {proc.stderr.strip()[:200] or f'exit {proc.returncode}'}")
    return proc.stdout


def ioctl_interfaces() -> list[Iface]:
    """Every interface's IPv4 address without the ``ip`` command (SIOCGIFADDR, SIOCGIFNETMASK)."""
    import fcntl

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), SIOCGIFNETMASK, request)[20:24])
            except OSError:
                continue  # no IPv4 address
            found.append(Iface(name, addr, ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen))
    return found


def read_network(facts: NodeFacts) -> None:
    """The node's IPv4 addresses, its interfaces, and the route to the rendezvous host
    (MASTER_ADDR as torchrun set it), each fact's error recorded apart."""
    facts.rendezvous = os.environ.get("MASTER_ADDR")
    with recorded(facts, "interfaces"):
        text = run_ip("-o", "-4", "addr")
        facts.interfaces = parse_addrs(text) if text is not None else ioctl_interfaces()
        facts.links = [name for _, name in socket.if_nameindex()]
    with recorded(facts, "rendezvous"):
        host = facts.rendezvous or ""
        facts.rendezvous_addr = str(ipaddress.IPv4Address(host)) if _is_ipv4(host) else _resolve(host)
    if facts.rendezvous_addr is None:
        return
    with recorded(facts, "route"):
        text = run_ip("-o", "route", "get", facts.rendezvous_addr)
        if text is not None:
            facts.route = parse_route_get(text)
        else:
            table = parse_proc_route(Path("/proc/net/route").read_text())
            facts.route = route_by_table(facts.rendezvous_addr, table, facts.interfaces)


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def _resolve(host: str) -> str:
    if not host:
        raise SiteFactError("MASTER_ADDR is not set")
    return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])


@contextlib.contextmanager
def recorded(facts: NodeFacts, name: str) -> Iterator[None]:
    """A fact read inside is recorded as unreadable, with why, when reading it fails."""
    try:
        yield
    except (OSError, ValueError, subprocess.SubprocessError) as exc:  # SiteFactError is a ValueError
        facts.errors[name] = f"{type(exc).__name__}: {exc}"


def read_node(plan: SitePlan, node: str) -> NodeFacts:
    """Everything the site checks need of this node (local rank 0 only)."""
    needs = plan.needs
    assert needs is not None
    facts = NodeFacts(node=node)
    read_network(facts)
    with recorded(facts, "infiniband"):
        root = Path("/sys/class/infiniband")
        for device in sorted(root.iterdir()) if root.is_dir() else []:
            states = []
            for port in sorted((device / "ports").glob("*")):
                with contextlib.suppress(OSError):  # a state file we may not read is left out
                    states.append(port_state((port / "state").read_text()))
            facts.infiniband.append((device.name, states))
    with recorded(facts, "shm"):
        where = os.path.expanduser(needs.snapshot_dir)
        facts.shm_is_dir = os.path.isdir(where)
        if facts.shm_is_dir:
            st = os.statvfs(where)
            facts.shm_size, facts.shm_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    facts.seen = {probe.key: read_probe(probe) for probe in plan.probes if probe.name}
    with recorded(facts, "environment"):
        facts.prefix = sys.prefix
        facts.missing = [module for _, module in needs.imports if not _importable(module)]
    return facts


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
