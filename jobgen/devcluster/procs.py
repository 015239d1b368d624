"""Find and stop the dev cluster's processes through /proc, and nobody else's.

A pid from a record may be stale (the machine rebooted, the daemon died and
the pid was reused), so a pid is only ever signalled after its command line
or environment proves it belongs to this cluster.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

# Set in every daemon's environment.  slurmd hands its environment to the
# slurmstepd processes it forks, so steps left behind by a killed slurmd are
# still recognisable as ours.
MARKER_ENV = "JOBGEN_DEVCLUSTER"


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def cmdline(pid: int) -> list[str]:
    raw = _read(f"/proc/{pid}/cmdline")
    if not raw:
        return []
    return [part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0")]


def environ(pid: int) -> dict[str, str]:
    raw = _read(f"/proc/{pid}/environ")
    env: dict[str, str] = {}
    for item in (raw or b"").split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _stat_fields(pid: int) -> list[str] | None:
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    text = raw.decode(errors="replace")
    return text[text.rfind(")") + 2 :].split()


def is_alive(pid: int | None) -> bool:
    """True for a running process; a zombie is dead (nobody may reap it soon)."""
    if not pid or pid <= 0:
        return False
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def ppid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def matches(pid: int | None, *needles: str) -> bool:
    """A live process whose command line contains every needle (as a substring)."""
    if not is_alive(pid):
        return False
    line = " ".join(cmdline(pid))  # type: ignore[arg-type]
    return bool(line) and all(needle in line for needle in needles)


def read_pidfile(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def netns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def pids_in_netns(ns_paths: Iterable[str]) -> set[int]:
    """Every process whose network namespace is one of the named ones."""
    inodes = {ino for ino in (netns_inode(p) for p in ns_paths) if ino is not None}
    found: set[int] = set()
    if not inodes:
        return found
    for pid in all_pids():
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                found.add(pid)
        except OSError:
            continue
    return found


def mntns_inode(pid: int | str) -> int | None:
    return netns_inode(f"/proc/{pid}/ns/mnt")


def pids_in_node_mntns(pids: Iterable[int]) -> set[int]:
    """Every process in the mount namespace of one of ``pids`` that are slurmd or slurmstepd,
    where that is a node's own (jobgen.devcluster.nodelocal): with the job processes that left
    their step's process tree and dropped the marker. A namespace this process or pid 1 is in
    is never a node's, so nothing of the host's is ever taken for the cluster's."""
    host = {mntns_inode("self"), mntns_inode(1)}
    daemons = [p for p in pids if comm(p) in ("slurmd", "slurmstepd")]
    inodes = {ino for ino in map(mntns_inode, daemons) if ino is not None} - host
    if not inodes:
        return set()
    return {pid for pid in all_pids() if mntns_inode(pid) in inodes}


def marked_pids(state_dir: str, slurm_conf: str) -> set[int]:
    """Our daemons and steps (by marker), and tasks that slurmd launched for us.

    The second catches job processes that escaped their step's process tree
    (setsid + double fork): slurmstepd exports SLURM_CONF (the daemon's, i.e.
    ours) and SLURMD_NODENAME into every task.  SLURM_CONF alone is not
    enough: a user's shell or a test runner may export it too.
    """
    found: set[int] = set()
    for pid in all_pids():
        env = environ(pid)
        if env.get(MARKER_ENV) == state_dir or (
            env.get("SLURM_CONF") == slurm_conf and "SLURMD_NODENAME" in env and "SLURM_JOB_ID" in env
        ):
            found.add(pid)
    return found


def with_descendants(roots: Iterable[int]) -> set[int]:
    """The roots plus every process below them, from one snapshot of /proc."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        parent = ppid(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    result: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in result:
            continue
        result.add(pid)
        stack.extend(children.get(pid, ()))
    return result


def own_lineage() -> set[int]:
    """This process and its ancestors: never signalled, even if they look like ours
    (``down`` may be run from inside a job step)."""
    lineage: set[int] = set()
    pid: int | None = os.getpid()
    while pid and pid not in lineage:
        lineage.add(pid)
        pid = ppid(pid)
    return lineage


def comm(pid: int) -> str:
    raw = _read(f"/proc/{pid}/comm")
    return raw.decode(errors="replace").strip() if raw else ""


def terminate(pids: Iterable[int], grace: float = 10.0, kill_first: Iterable[int] = ()) -> list[int]:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; return the pids killed hard.

    ``kill_first`` get SIGKILL straight away: slurmstepd ignores SIGTERM, and
    waiting out the grace for it would only slow ``down`` by ``grace`` seconds.
    """
    targets = {p for p in pids if is_alive(p)} - own_lineage()
    for pid in set(kill_first) & targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(targets)
        if not any(is_alive(p) for p in targets):
            return []
        time.sleep(0.1)
    killed = [p for p in targets if is_alive(p)]
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(is_alive(p) for p in killed):
        _reap(killed)
        time.sleep(0.05)
    return killed


def _reap(pids: Iterable[int]) -> None:
    """Reap those of ``pids`` that are this process's own children (when up and
    down run in one process); only named pids, so other code's children keep
    their exit status."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
