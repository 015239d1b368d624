"""Install, start and watch the dev cluster's daemons: munged, slurmctld, slurmd
(slurmdbd and its MariaDB are started by ``accounting``; they are watched here too).

Owns the daemons one by one: installing their packages, starting each, telling
which of a recorded cluster's are alive (:func:`live_daemons`), and waiting for
the nodes to answer. The order of bringing a cluster up is ``lifecycle``'s.

What ``up`` runs, for a state dir S::

    munged -F                                   (as user munge, only if munge is not answering)
    mariadbd --no-defaults --datadir=S/mariadb/data ...   (as user mysql; see accounting.py)
    slurmdbd -D                                 (SLURM_CONF=S/slurm.conf: reads S/slurmdbd.conf)
    slurmctld -D -i -f S/slurm.conf
    slurmd -D -f S/slurm.conf -N node1          (netns mode: nsenter --net=/run/netns/jgnode1 slurmd ...)

and, where the nodes can have node-local directories (root, util-linux), each slurmd behind
``unshare --mount ... sh -c 'mount --bind ... && exec "$@"'`` (see nodelocal.py).

Daemons run in the foreground of their own session (``-D`` under
``start_new_session``), so the pid is known at once and an early crash is
noticed while ``up`` is still waiting, instead of after a timeout.
"""

from __future__ import annotations

import contextlib
import grp
import itertools
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from jobgen.slurm import client

from . import nodelocal, procs, slurm_builds
from .config import Layout
from .state import ClusterError, State

SLURM_BINARIES = ("slurmctld", "slurmd", "sinfo", "sbatch", "srun", "scontrol", "munged", "munge", "unmunge")
# Accounting: slurmdbd on the cluster's own MariaDB (Debian's packages), and the clients.
ACCOUNTING_BINARIES = ("slurmdbd", "sacct", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb")
# The Debian package that brings each binary `up` runs, so only what is missing is installed.
PACKAGE_OF = {
    **dict.fromkeys(SLURM_BINARIES, "slurm-wlm"),
    **dict.fromkeys(("munged", "munge", "unmunge"), "munge"),
    "sacct": "slurm-wlm",
    "sacctmgr": "slurm-wlm",
    "slurmdbd": "slurmdbd",
    **dict.fromkeys(("mariadbd", "mariadb-install-db", "mariadb"), "mariadb-server"),
    "ip": "iproute2",
    "nsenter": "util-linux",
}
# Debian's hook that decides whether a package's maintainer scripts may start its service.
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUNDIR = Path("/run/munge")
MUNGE_DIRS = (Path("/var/log/munge"), Path("/var/lib/munge"))
DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def log(msg: str) -> None:
    print(f"[jobgen cluster] {msg}", file=sys.stderr, flush=True)


def missing_binaries(extra: tuple[str, ...] = ()) -> list[str]:
    return [b for b in SLURM_BINARIES + ACCOUNTING_BINARIES + extra if shutil.which(b, path=DAEMON_PATH) is None]


@contextlib.contextmanager
def no_service_starts() -> Iterator[None]:
    """Keep apt's maintainer scripts from starting the services they install: installing
    mariadb-server would otherwise start the machine's own MariaDB on port 3306 (and
    slurmdbd's fail without a config). The cluster starts its own copies. A policy-rc.d
    that is already there (containers have one) is left as it is."""
    if os.path.lexists(POLICY_RC_D):
        yield
        return
    POLICY_RC_D.write_text("#!/bin/sh\n# Written by `jobgen cluster up` while it runs apt-get.\nexit 101\n")
    POLICY_RC_D.chmod(0o755)
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def apt_install(packages: list[str]) -> None:
    """``apt-get update && apt-get install -y PACKAGES``, failing with apt's own words."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with no_service_starts():
        _apt_get(env, packages)


def _apt_get(env: dict[str, str], packages: list[str]) -> None:
    for args in (["apt-get", "update"], ["apt-get", "install", "-y", *packages]):
        log(f"running {' '.join(args)}")
        proc = subprocess.run(args, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
            if args[1] == "update":
                # Offline, the package lists and .debs already on disk may do.
                log(f"warning: apt-get update failed; trying the install anyway:\n{tail}")
                continue
            raise ClusterError(f"`{' '.join(args)}` failed (exit {proc.returncode}):\n{tail}")


def daemon_env(state_dir: Path, slurm_conf: Path, slurm_prefix: str = "") -> dict[str, str]:
    """A clean environment for the daemons: the caller's venv or PYTHONPATH must
    not leak into every job, and the marker lets ``down`` find leftover steps. A built Slurm's
    (``slurm_prefix``) programs come first on PATH."""
    return {
        "PATH": slurm_builds.search_path(slurm_prefix, DAEMON_PATH),
        "LANG": "C.UTF-8",
        "HOME": "/root",
        "SLURM_CONF": str(slurm_conf),
        procs.MARKER_ENV: str(state_dir),
    }


def spawn(argv: list[str], out: Path, env: dict[str, str], **kwargs: object) -> int:
    """Start ``argv`` in its own session with output appended to ``out``; return its pid."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "ab") as fh:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
            **kwargs,  # type: ignore[arg-type]
        )
    return proc.pid


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"    ({path}: missing)"
    body = "\n".join("    " + line for line in text.splitlines()[-lines:])
    return f"  --- {path} (last {lines} lines) ---\n{body or '    (empty)'}"


# --- munge -----------------------------------------------------------------


def munge_answers() -> bool:
    """``munge -n | unmunge``: the test every Slurm daemon's auth depends on."""
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        check = subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10)
        return check.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_munge_key() -> bool:
    """Make /etc/munge/munge.key exist, owned by munge, mode 0400; True if created here."""
    munge = pwd.getpwnam("munge")
    created = False
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(MUNGE_KEY.parent, munge.pw_uid, munge.pw_gid)
        fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))
        created = True
    st = MUNGE_KEY.stat()
    if (st.st_uid, st.st_gid) != (munge.pw_uid, munge.pw_gid):
        os.chown(MUNGE_KEY, munge.pw_uid, munge.pw_gid)
    if st.st_mode & 0o077:
        # munged refuses a key that group or others can read.
        os.chmod(MUNGE_KEY, 0o400)
    return created


def start_munged(layout: Layout) -> tuple[int, bool]:
    """Start munged as user munge; return (pid, whether /run/munge was created)."""
    munge = pwd.getpwnam("munge")
    group = grp.getgrgid(munge.pw_gid)
    rundir_created = not MUNGE_RUNDIR.exists()
    for path in (MUNGE_RUNDIR, *MUNGE_DIRS):
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, munge.pw_uid, munge.pw_gid)
    MUNGE_RUNDIR.chmod(0o755)  # plain users' clients must reach the socket
    pid = spawn(
        ["munged", "-F"],
        layout.stdout_log("munged"),
        {"PATH": DAEMON_PATH, "LANG": "C.UTF-8"},
        user=munge.pw_uid,
        group=group.gr_gid,
        extra_groups=[],
        cwd="/",
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if munge_answers():
            return pid, rundir_created
        if not procs.is_alive(pid):
            break
        time.sleep(0.2)
    raise ClusterError(
        "munged did not start answering `munge -n | unmunge`:\n"
        + tail(layout.stdout_log("munged"))
        + "\n"
        + tail(Path("/var/log/munge/munged.log"))
    )


# --- slurm -----------------------------------------------------------------


def start_slurmctld(layout: Layout, env: dict[str, str]) -> int:
    # -i: ignore state files a killed earlier run may have left half-written.
    return spawn(
        ["slurmctld", "-D", "-i", "-f", str(layout.slurm_conf)],
        layout.stdout_log("slurmctld"),
        env,
        cwd=str(layout.root),
    )


def start_slurmd(
    layout: Layout, env: dict[str, str], node: str, netns_path: str | None, node_local: bool = False
) -> int:
    """Start ``slurmd -N node``, in the node's network namespace (netns mode) and with its own
    mount namespace for the node-local directory (``node_local``); each wrapper execs the next,
    so the pid is slurmd's."""
    argv = ["slurmd", "-D", "-f", str(layout.slurm_conf), "-N", node]
    if netns_path:
        # nsenter, not `ip netns exec`: the latter remounts /sys, and slurmd
        # then fails to initialise.  nsenter execs slurmd, so the pid is slurmd's.
        argv = ["nsenter", f"--net={netns_path}", "--", *argv]
    if node_local:
        argv = nodelocal.wrap(argv, layout, node)
    return spawn(argv, layout.stdout_log(f"slurmd.{node}"), env, cwd=str(layout.root))


def slurmctld_matches(pid: int | None, layout: Layout) -> bool:
    return procs.matches(pid, "slurmctld", str(layout.slurm_conf))


def slurmd_matches(pid: int | None, layout: Layout, node: str) -> bool:
    if not procs.matches(pid, "slurmd", str(layout.slurm_conf)):
        return False
    argv = procs.cmdline(pid)  # type: ignore[arg-type]
    return any(a == "-N" and b == node for a, b in itertools.pairwise(argv))


def mariadb_matches(pid: int | None, layout: Layout) -> bool:
    return procs.matches(pid, "mariadbd", f"--datadir={layout.mariadb_datadir}")


def slurmdbd_matches(pid: int | None, layout: Layout) -> bool:
    """slurmdbd has no config-file option, so its command line names nothing of ours: the
    marker in its environment does, or, for a plain user, who may not read root's
    environment, its own pid file in our run dir."""
    if not procs.matches(pid, "slurmdbd"):
        return False
    marker = procs.environ(pid).get(procs.MARKER_ENV)  # type: ignore[arg-type]
    if marker is not None:
        return marker == str(layout.root)
    return os.geteuid() != 0 and pid == procs.read_pidfile(layout.slurmdbd_pidfile)


def daemon_names(state: State) -> list[str]:
    """Every daemon the record's cluster runs (not munged), in the order they start; a
    record written before the cluster had accounting names no slurmdbd."""
    accounting = ["mariadb", "slurmdbd"] if state.info.slurmdbd_port else []
    return [*accounting, "slurmctld", *(f"slurmd:{n}" for n in state.info.nodes)]


def live_daemons(state: State) -> dict[str, int]:
    """The daemons (not munged) of this cluster that are running, by name."""
    layout = Layout(Path(state.info.state_dir))
    live = {}
    for name in daemon_names(state):
        # The daemon's own pid file too: `up` may have been killed between
        # starting a daemon and recording its pid.
        for pid in (state.resources.daemons.get(name), procs.read_pidfile(_pidfile(name, layout))):
            if _is_our_daemon(name, pid, layout):
                live[name] = pid  # type: ignore[assignment]
                break
    return live


def _pidfile(name: str, layout: Layout) -> Path:
    fixed = {
        "slurmctld": layout.slurmctld_pidfile,
        "slurmdbd": layout.slurmdbd_pidfile,
        "mariadb": layout.mariadb_pidfile,
    }
    return fixed.get(name) or layout.slurmd_pidfile(name.removeprefix("slurmd:"))


def _is_our_daemon(name: str, pid: int | None, layout: Layout) -> bool:
    if name == "slurmctld":
        return slurmctld_matches(pid, layout)
    if name == "slurmdbd":
        return slurmdbd_matches(pid, layout)
    if name == "mariadb":
        return mariadb_matches(pid, layout)
    return slurmd_matches(pid, layout, name.removeprefix("slurmd:"))


def node_states(slurm_conf: Path | str, timeout: float = 10.0, slurm_prefix: str = "") -> dict[str, str]:
    """``sinfo -N``: node name to its state (e.g. "idle", "idle*", "down*", "mix"); the sinfo of
    the cluster's own Slurm (``slurm_prefix``, where it is a built one), whatever the caller's
    PATH holds first."""
    path = slurm_builds.search_path(slurm_prefix, DAEMON_PATH)
    try:
        return client.node_states(slurm_conf=str(slurm_conf), path=path, timeout=timeout)
    except client.SlurmError as exc:
        raise ClusterError(f"sinfo failed: {exc.stderr}") from None


RESPONSIVE = {"idle", "mix", "alloc", "comp", "resv", "plnd"}


def wait_for_nodes(
    layout: Layout,
    nodes: list[str],
    watched: dict[str, int],
    timeout: float,
    want: set[str] | None = None,
    slurm_prefix: str = "",
) -> dict[str, str]:
    """Wait until every node's sinfo state is in ``want`` (default: only "idle").

    ``watched`` maps daemon names to pids; if one dies meanwhile, fail at once.
    """
    want = want or {"idle"}
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    last_error = ""
    while True:
        for name, pid in watched.items():
            if not procs.is_alive(pid):
                raise ClusterError(f"{name} (pid {pid}) exited during startup:\n" + logs_report(layout, nodes))
        try:
            states = node_states(layout.slurm_conf, slurm_prefix=slurm_prefix)
            last_error = ""
        except (ClusterError, subprocess.TimeoutExpired) as exc:
            last_error = str(exc)
        if states and all(states.get(n) in want for n in nodes):
            return states
        if time.monotonic() > deadline:
            raise ClusterError(
                f"nodes did not become {'/'.join(sorted(want))} within {timeout:.0f}s "
                f"(sinfo: {states or last_error}):\n" + logs_report(layout, nodes)
            )
        time.sleep(0.5)


def logs_report(layout: Layout, nodes: list[str]) -> str:
    parts = [tail(layout.slurmctld_log), tail(layout.stdout_log("slurmctld"), 5), tail(layout.slurmdbd_log, 5)]
    for node in nodes:
        parts.append(tail(layout.slurmd_log(node), 10))
        parts.append(tail(layout.stdout_log(f"slurmd.{node}"), 5))
    return "\n".join(parts)
