"""A real local Slurm cluster for tests and demos: munged, slurmctld, N slurmd, and
slurmdbd on a MariaDB server of its own (accounting: ``sacct``).

From the shell::

    jobgen cluster up --nodes 2 [--netns]     # idempotent; restarts dead daemons
    jobgen cluster up --nodes 2 --gpus 3,1    # fake GPUs (GRES gpu) Slurm schedules
    jobgen cluster status                     # exit 1 when not up
    jobgen cluster down                       # undoes exactly what `up` did

From Python (tests, fixtures)::

    import jobgen.devcluster as devcluster
    info = devcluster.status() or devcluster.up(nodes=2, netns=True)
    info.nodes, info.node_addrs, info.nic, info.slurm_conf
    devcluster.down()

All configuration and state live in one directory (default
/var/tmp/jobgen-cluster, or $JOBGEN_CLUSTER_DIR, or ``state_dir=``), plus a
symlink /etc/slurm/slurm.conf so that every Slurm command works for every user
without extra environment.  See lifecycle.py for the rules ``up``/``down`` follow
(``down`` itself is in teardown.py).
"""

from .config import DEFAULT_PARTITION, PARTITIONS, SHORT_MAX_TIME, SLURMCTLD_PORT
from .lifecycle import status, up
from .state import DEFAULT_STATE_DIR, STATE_DIR_ENV, SYSTEM_SERIES, ClusterError, ClusterInfo, resolve_state_dir
from .teardown import down

__all__ = [
    "DEFAULT_PARTITION",
    "DEFAULT_STATE_DIR",
    "PARTITIONS",
    "SHORT_MAX_TIME",
    "SLURMCTLD_PORT",
    "STATE_DIR_ENV",
    "SYSTEM_SERIES",
    "ClusterError",
    "ClusterInfo",
    "down",
    "resolve_state_dir",
    "status",
    "up",
]
