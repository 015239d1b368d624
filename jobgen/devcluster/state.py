"""The dev cluster's persistent record: what it looks like and what `up` created.

Everything lives in one JSON file, ``<state_dir>/state.json``, so that another
process (a test in a pytest worker, ``jobgen cluster status`` in a shell, a
plain user) can find the cluster without talking to the process that started
it, and so that ``down`` can undo exactly what ``up`` did even when ``up`` was
killed half way.  ``up`` saves the record after every resource it creates.
Also what guards changing it: the machine-wide lock and the root check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobgen.base.atomic import write_text_atomic

DEFAULT_STATE_DIR = "/var/tmp/jobgen-cluster"
STATE_DIR_ENV = "JOBGEN_CLUSTER_DIR"
STATE_FILE = "state.json"
# The Slurm series of this machine's packages (Debian bookworm's slurm-wlm): what `up` runs
# unless asked for a built one (jobgen.devcluster.slurm_builds).
SYSTEM_SERIES = "22.05"

# One lock for every dev cluster on the machine, whatever its state dir: they
# all compete for the same ports, /etc/slurm/slurm.conf and /etc/hosts.  A
# directory that always exists is locked, so that no lock file is left behind.
GLOBAL_LOCK_PATH = "/var/tmp"


class ClusterError(RuntimeError):
    """A dev-cluster operation failed; the message says why and what to do."""


def require_root(action: str) -> None:
    """``up`` and ``down`` start daemons and edit /etc: root only."""
    if os.geteuid() != 0:
        raise ClusterError(f"`jobgen cluster {action}` must run as root (it starts daemons and edits /etc)")


def resolve_state_dir(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """The state dir to use: the argument, else $JOBGEN_CLUSTER_DIR, else the default."""
    if state_dir is None or str(state_dir) == "":
        state_dir = os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR
    return Path(state_dir).expanduser().absolute()


@dataclass
class ClusterInfo:
    """What a running dev cluster looks like, as recorded by ``up``.

    ``node_states`` and ``daemons`` are filled in by ``status()`` from the live
    cluster (``sinfo`` and the recorded pids); the rest comes from the record.
    """

    state_dir: str
    nodes: list[str]
    netns: bool
    node_addrs: dict[str, str]
    nic: str
    partitions: list[str]
    slurm_conf: str
    default_partition: str = "debug"
    cpus_per_node: int = 4
    mem_per_node_mb: int = 4096
    hostname: str = ""
    controller_addr: str = "127.0.0.1"
    slurmctld_port: int = 16817
    slurmd_ports: dict[str, int] = field(default_factory=dict)
    # Accounting: slurmdbd at controller_addr, its MariaDB on 127.0.0.1 (0: no accounting,
    # a record written before the dev cluster had it).
    slurmdbd_port: int = 0
    mariadb_port: int = 0
    bridge: str | None = None
    netns_names: dict[str, str] = field(default_factory=dict)
    # Which of the machine's dev clusters this is (jobgen.devcluster.instances): its node names,
    # bridge, ports and /etc/hosts block follow from it. 0 for a record written before there could
    # be several.
    instance: int = 0
    log_dir: str = ""
    created_at: float = 0.0
    # Fake GPUs (GRES gpu) per node, `cluster up --gpus`; none on a node not named.
    gpus: dict[str, int] = field(default_factory=dict)
    # The path each node sees as a directory of its own, like a real node's /local/scratch
    # (jobgen.devcluster.nodelocal), and, node by node, where the host finds that directory.
    # "" and {} where the nodes cannot have one (not root, no unshare), or in a record from before.
    node_local: str = ""
    node_local_dirs: dict[str, str] = field(default_factory=dict)
    # Which Slurm runs it: SYSTEM_SERIES, this machine's packages, or a release built into
    # slurm_prefix (jobgen.devcluster.slurm_builds), whose bin/ whoever reaches the cluster puts
    # first on PATH. A record from before there was a choice is SYSTEM_SERIES.
    slurm: str = SYSTEM_SERIES
    slurm_prefix: str = ""
    node_states: dict[str, str] = field(default_factory=dict)
    daemons: dict[str, int] = field(default_factory=dict)

    @property
    def shape(self) -> dict[str, Any]:
        """The parameters that decide whether a second ``up`` is a no-op."""
        return {
            "nodes": len(self.nodes),
            "cpus_per_node": self.cpus_per_node,
            "mem_per_node_mb": self.mem_per_node_mb,
            "netns": self.netns,
            "gpus": [self.gpus.get(node, 0) for node in self.nodes],
            "slurm": self.slurm,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterInfo:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Resources:
    """Everything ``up`` created or started, so ``down`` can undo exactly that.

    Pids of processes are verified against their command line before being
    signalled, because a pid from a stale record may belong to someone else now.
    """

    apt_installed: list[str] = field(default_factory=list)
    munged_pid: int | None = None
    munge_key_created: bool = False
    munge_rundir_created: bool = False
    slurm_conf_symlink: str | None = None
    daemons: dict[str, int] = field(default_factory=dict)
    netns_dir_created: bool = False
    bridge: str | None = None
    veths: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    hosts_block: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Resources:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class State:
    """The whole record: ``phase`` is "starting" until every daemon answered, then "up"."""

    info: ClusterInfo
    resources: Resources = field(default_factory=Resources)
    phase: str = "starting"

    def to_json(self) -> str:
        return json.dumps(
            {
                "phase": self.phase,
                "info": self.info.to_dict(),
                "resources": dataclasses.asdict(self.resources),
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> State:
        data = json.loads(text)
        return cls(
            info=ClusterInfo.from_dict(data["info"]),
            resources=Resources.from_dict(data.get("resources", {})),
            phase=data.get("phase", "starting"),
        )


def state_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def load_state(state_dir: Path) -> State | None:
    """The record in ``state_dir``, or None when there is none (or it is unreadable)."""
    try:
        text = state_path(state_dir).read_text()
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        raise ClusterError(f"cannot read {state_path(state_dir)}: {exc}") from exc
    try:
        return State.from_json(text)
    except (ValueError, KeyError, TypeError):
        # Writes are atomic, so this is a hand-edited or foreign file: treat
        # it as no record rather than crash every status() caller.
        return None


def save_state(state: State) -> None:
    """Write the record atomically, so concurrent readers never see half a file."""
    state_dir = Path(state.info.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    # Readable by plain users, who run `jobgen cluster status` and tests.
    write_text_atomic(state_path(state_dir), state.to_json(), mode=0o644)


@contextlib.contextmanager
def global_lock(timeout: float = 600.0) -> Iterator[None]:
    """Serialise up/down across processes (pytest-xdist workers, two shells)."""
    fd = os.open(GLOBAL_LOCK_PATH, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"another `jobgen cluster up/down` holds the lock on "
                        f"{GLOBAL_LOCK_PATH} for more than {timeout:.0f}s"
                    ) from exc
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # closing the fd releases the flock
