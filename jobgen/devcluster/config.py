"""Render the dev cluster's slurm.conf and slurmdbd.conf and decide its layout on disk.

The settings follow what was measured on the 2-core, GPU-less build machines
(see "Facts measured on this machine kind" in the design): root daemons with
no cgroups, several ``slurmd -N nodeK`` on one host, CPUs declared beyond the
real core count, and timings that make failure tests finish in seconds.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

SLURMCTLD_PORT = 16817
# Off Slurm's defaults (6817/6818) so a system Slurm on the same host is left alone.
SLURMD_BASE_PORT = 17001
CLUSTER_NAME = "jobgen"
# Preferred ports of the accounting daemons, off their defaults (6819, 3306) for the same
# reason; `up` takes a free one instead when another process holds one of these.
SLURMDBD_PORT = 16819
MARIADB_PORT = 16806
# The database and its user that slurmdbd gets in the cluster's own MariaDB.
ACCT_DB_NAME = "slurm_acct_db"
ACCT_DB_USER = "slurm"
# The SlurmUser of every daemon here; slurmdbd.conf must be owned by it, mode 0600.
SLURM_USER = "root"

PARTITIONS = ("debug", "short")
DEFAULT_PARTITION = "debug"
DEBUG_MAX_TIME = "1-00:00:00"
# Short on purpose: the preflight tests submit a job whose time exceeds it.
SHORT_MAX_TIME = "00:05:00"


@dataclass(frozen=True)
class Layout:
    """Where every file of one dev cluster lives, all below its state dir."""

    root: Path

    @property
    def slurm_conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def gres_conf(self) -> Path:
        """Read by every slurmd from slurm.conf's directory: each node's GPUs and their files."""
        return self.root / "gres.conf"

    @property
    def gpu_dir(self) -> Path:
        """The nodes' fake GPU device files (:func:`make_gpu_files`)."""
        return self.root / "gpus"

    def gpu_files(self, node: str, count: int) -> list[Path]:
        return [self.gpu_dir / node / f"nvidia{i}" for i in range(count)]

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def ctld_state(self) -> Path:
        return self.root / "slurmctld"

    @property
    def spool_dir(self) -> Path:
        return self.root / "spool"

    @property
    def slurmctld_pidfile(self) -> Path:
        return self.run_dir / "slurmctld.pid"

    @property
    def slurmctld_log(self) -> Path:
        return self.log_dir / "slurmctld.log"

    @property
    def slurmdbd_conf(self) -> Path:
        # Beside slurm.conf: slurmdbd looks for it in the directory of $SLURM_CONF.
        return self.root / "slurmdbd.conf"

    @property
    def slurmdbd_pidfile(self) -> Path:
        return self.run_dir / "slurmdbd.pid"

    @property
    def slurmdbd_log(self) -> Path:
        return self.log_dir / "slurmdbd.log"

    @property
    def mariadb_dir(self) -> Path:
        """Everything of the cluster's MariaDB (datadir, socket, pid file, error log), owned
        by the user mariadbd runs as, which may write nowhere else."""
        return self.root / "mariadb"

    @property
    def mariadb_datadir(self) -> Path:
        return self.mariadb_dir / "data"

    @property
    def mariadb_socket(self) -> Path:
        return self.mariadb_dir / "mariadb.sock"

    @property
    def mariadb_pidfile(self) -> Path:
        return self.mariadb_dir / "mariadbd.pid"

    @property
    def mariadb_log(self) -> Path:
        return self.mariadb_dir / "mariadbd.log"

    @property
    def node_local(self) -> Path:
        """The path every node sees as a directory of its own, as a real cluster's nodes see
        their own /local/scratch (jobgen.devcluster.nodelocal); on the host an empty mountpoint."""
        return self.root / "node-local"

    @property
    def nodes_dir(self) -> Path:
        return self.root / "nodes"

    def node_local_source(self, node: str) -> Path:
        """``node``'s own directory, which it sees at :attr:`node_local`: the host's view of it."""
        return self.nodes_dir / node / "local"

    def slurmd_pidfile(self, node: str) -> Path:
        return self.run_dir / f"slurmd.{node}.pid"

    def slurmd_log(self, node: str) -> Path:
        return self.log_dir / f"slurmd.{node}.log"

    def stdout_log(self, daemon: str) -> Path:
        """stdout/stderr of a daemon: what it says before its own log is open."""
        return self.log_dir / f"{daemon}.out"

    def mkdirs(self, nodes: list[str]) -> None:
        # slurmd creates its spool dir itself, but complains first that the
        # domain socket directory is missing.
        node_spools = [self.spool_dir / node for node in nodes]
        for path in (self.root, self.log_dir, self.run_dir, self.ctld_state, self.spool_dir, *node_spools):
            path.mkdir(parents=True, exist_ok=True)
            # Plain users read slurm.conf and the logs (sinfo, jobgen status).
            path.chmod(0o755)


def node_names(count: int) -> list[str]:
    """Instance 0's node names (jobgen.devcluster.instances.Instance.node_names for any)."""
    return [f"node{k}" for k in range(1, count + 1)]


# The settings that follow from the dev cluster's design alone (no path, host or node in them).
_SETTINGS = (
    "SlurmUser=root",
    "SlurmdUser=root",
    "AuthType=auth/munge",
    "CredType=cred/munge",
    "",
    "# No cgroups here: track job processes by parentage and bind nothing.",
    "ProctrackType=proctrack/linuxproc",
    "TaskPlugin=task/none",
    "JobAcctGatherType=jobacct_gather/none",
    "MpiDefault=none",
    "SwitchType=switch/none",
    "MailProg=/bin/true",
    "",
    "# CPUs are the only consumable; memory is advisory so jobs never",
    "# pend on the host's real memory.",
    "SelectType=select/cons_tres",
    "SelectTypeParameters=CR_CPU",
    "# Declared CPUs may exceed the host's real cores.",
    "SlurmdParameters=config_overrides",
    "",
    "# Reject at submission what can never run (e.g. --time above the",
    "# partition's MaxTime), as production clusters do; Slurm's default",
    "# accepts such a job and leaves it pending forever.",
    "EnforcePartLimits=ALL",
    "SchedulerType=sched/backfill",
    "SchedulerParameters=sched_interval=5,bf_interval=5",
    "",
    "# Accounting (sacct) goes to slurmdbd (AccountingStorage* below); finished",
    "# jobs also stay visible to `scontrol show job` for 10 minutes.",
    "JobCompType=jobcomp/none",
    "MinJobAge=600",
    "MaxArraySize=1001",
    "KillWait=30",
    "JobRequeue=1",
    "# Tests kill a slurmd and expect its node DOWN within ~20s and back",
    "# as soon as the slurmd registers again.",
    "SlurmdTimeout=20",
    "ReturnToService=2",
    "SlurmctldTimeout=30",
    "InactiveLimit=0",
    "MessageTimeout=10",
)


def render_slurm_conf(
    *,
    layout: Layout,
    hostname: str,
    controller_addr: str,
    node_addrs: dict[str, str],
    cpus_per_node: int,
    mem_per_node_mb: int,
    slurmdbd_port: int,
    slurmctld_port: int = SLURMCTLD_PORT,
    slurmd_ports: dict[str, int] | None = None,
    gpus: dict[str, int] | None = None,
    own_hosts: bool = False,
) -> str:
    """The slurm.conf text for the nodes of ``node_addrs`` (node1..nodeN for instance 0).

    One NodeName line per node, because in netns mode every node has its own
    address; the ports follow node order (17001, 17002, ... for instance 0). With
    ``own_hosts`` (netns mode) each node is its own host, NodeHostname its name: Slurm 24.11
    keeps one node per NodeHostname in its map of hosts and could not forward to the others
    ("Duplicated NodeHostName", then "can't find address for host node2"; measured).  slurmdbd
    runs beside slurmctld and is reached at the controller's address, which the
    host's client commands (sacct, sacctmgr) and, in netns mode, the nodes reach.
    """
    nodes = list(node_addrs)
    hostlist = ",".join(nodes)
    ports = slurmd_ports or {name: SLURMD_BASE_PORT + i for i, name in enumerate(nodes)}
    node_lines = [
        f"NodeName={name} NodeHostname={name if own_hosts else hostname} NodeAddr={addr} "
        f"Port={ports[name]} CPUs={cpus_per_node} "
        f"RealMemory={mem_per_node_mb}{_gres(name, gpus or {})} State=UNKNOWN"
        for name, addr in node_addrs.items()
    ]
    return "\n".join(
        [
            "# Written by `jobgen cluster up`; removed by `jobgen cluster down`.",
            "# A dev cluster: several `slurmd -N nodeK` on one host.",
            f"ClusterName={CLUSTER_NAME}",
            f"SlurmctldHost={hostname}({controller_addr})",
            f"SlurmctldPort={slurmctld_port}",
            *_SETTINGS,
            *_gres_types(gpus or {}),
            "AccountingStorageType=accounting_storage/slurmdbd",
            f"AccountingStorageHost={controller_addr}",
            f"AccountingStoragePort={slurmdbd_port}",
            "# Without it sacct's Comment stays empty: the job's comment (jobgen's exit",
            "# reason) is stored only with this flag.",
            "AccountingStoreFlags=job_comment",
            "",
            *_file_lines(layout),
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "",
            *node_lines,
            "",
            f"PartitionName={DEFAULT_PARTITION} Nodes={hostlist} Default=YES MaxTime={DEBUG_MAX_TIME} State=UP",
            f"PartitionName=short Nodes={hostlist} MaxTime={SHORT_MAX_TIME} State=UP",
            "",
        ]
    )


def _gres_types(gpus: dict[str, int]) -> list[str]:
    """What slurm.conf says of GPUs when a node has any: none of it otherwise."""
    if not any(gpus.values()):
        return []
    return [
        "# GPUs (GRES) on the nodes that have them: gres.conf names their files; accounting counts them.",
        "GresTypes=gpu",
        "AccountingStorageTRES=gres/gpu",
        "",
    ]


def _gres(node: str, gpus: dict[str, int]) -> str:
    return f" Gres=gpu:{gpus[node]}" if gpus.get(node) else ""


def render_gres_conf(layout: Layout, gpus: dict[str, int]) -> str:
    """gres.conf: each node's GPUs as device files (:func:`make_gpu_files`), as Slurm's own test
    suite fakes them. Slurm sets CUDA_VISIBLE_DEVICES from the GPUs a job step is given."""
    lines = ["# Written by `jobgen cluster up --gpus`; fake GPUs, one device file each.", "AutoDetect=off"]
    for node, count in gpus.items():
        if count:
            files = layout.gpu_files(node, count)
            name = files[0].name if count == 1 else f"nvidia[0-{count - 1}]"
            lines.append(f"NodeName={node} Name=gpu File={files[0].parent}/{name}")
    return "\n".join(lines) + "\n"


def make_gpu_files(layout: Layout, gpus: dict[str, int]) -> None:
    """Each node's fake GPUs: character devices with /dev/null's numbers (slurmd takes a GPU's
    file for a device, reads its major and minor, and never opens it)."""
    for node, count in gpus.items():
        for path in layout.gpu_files(node, count):
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))


def _file_lines(layout: Layout) -> list[str]:
    """Where the daemons keep their state, pid files and logs (``%n``: the node's name)."""
    return [
        f"StateSaveLocation={layout.ctld_state}",
        f"SlurmctldPidFile={layout.slurmctld_pidfile}",
        f"SlurmctldLogFile={layout.slurmctld_log}",
        f"SlurmdSpoolDir={layout.spool_dir}/%n",
        f"SlurmdPidFile={layout.run_dir}/slurmd.%n.pid",
        f"SlurmdLogFile={layout.log_dir}/slurmd.%n.log",
    ]


def render_slurmdbd_conf(
    *, layout: Layout, hostname: str, dbd_addr: str, dbd_port: int, mariadb_port: int, password: str
) -> str:
    """The slurmdbd.conf text: slurmdbd on ``dbd_addr:dbd_port`` (the address slurm.conf's
    AccountingStorageHost names), storing into the cluster's MariaDB on 127.0.0.1.

    The file holds the database password, so it is written mode 0600 (slurmdbd refuses
    it otherwise) and the password is nowhere else.
    """
    return "\n".join(
        [
            "# Written by `jobgen cluster up`; removed by `jobgen cluster down`.",
            "AuthType=auth/munge",
            f"DbdHost={hostname}",
            f"DbdAddr={dbd_addr}",
            f"DbdPort={dbd_port}",
            f"SlurmUser={SLURM_USER}",
            "DebugLevel=info",
            f"LogFile={layout.slurmdbd_log}",
            f"PidFile={layout.slurmdbd_pidfile}",
            "StorageType=accounting_storage/mysql",
            # TCP, not the socket: the client library's default socket is the system
            # MariaDB's, which this cluster never uses.
            "StorageHost=127.0.0.1",
            f"StoragePort={mariadb_port}",
            f"StorageLoc={ACCT_DB_NAME}",
            f"StorageUser={ACCT_DB_USER}",
            f"StoragePass={password}",
            "",
        ]
    )
