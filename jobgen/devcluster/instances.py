"""Several dev clusters on one machine: each one an instance, numbered from 0.

Everything two clusters could both want is derived from the instance's number: node names
(``node1..`` for instance 0, ``node101..`` for 1, ``node201..`` for 2), the bridge (``jgbr0``,
``jgbr1``...), the ports of slurmctld, the slurmds, slurmdbd and MariaDB (20 apart), and the
block of /etc/hosts. Each network gets the first free private /24 (jobgen.devcluster.netns).
Only one cluster can own /etc/slurm/slurm.conf: the first one up; the others are reached
with ``SLURM_CONF`` set to their own slurm.conf (``jobgen cluster status`` prints it).

The registry is a directory of small files, ``/var/tmp/jobgen-clusters/<number>``, each
holding the state dir of the cluster that claimed the number; it changes only under the
machine-wide lock of ``up`` and ``down``. A number whose cluster has no record any more is
free again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REGISTRY = Path("/var/tmp/jobgen-clusters")
# Nodes per cluster: the names of one instance never reach the next one's.
MAX_NODES = 99
# Ports between two instances' sets (slurmctld, slurmds, slurmdbd, MariaDB).
PORT_STRIDE = 20
MAX_INSTANCES = 50


@dataclass(frozen=True)
class Instance:
    """One dev cluster's number and the names and ports that follow from it."""

    number: int

    def node_names(self, count: int) -> list[str]:
        return [f"node{100 * self.number + k}" for k in range(1, count + 1)]

    @property
    def bridge(self) -> str:
        return f"jgbr{self.number}"

    @property
    def hosts_marker(self) -> str:
        """The name of its block in /etc/hosts (instance 0's is the one jobgen always wrote)."""
        return "jobgen-cluster" if self.number == 0 else f"jobgen-cluster-{self.number}"

    def port(self, base: int) -> int:
        return base + PORT_STRIDE * self.number


def _owner(entry: Path) -> Path | None:
    try:
        return Path(entry.read_text().strip())
    except OSError:
        return None


def claim(state_dir: Path, *, alive) -> Instance:
    """The number of the cluster in ``state_dir``: the one it holds, else the lowest one that no
    other cluster holds (``alive(state_dir)``: whether a cluster is recorded there). Call it
    under the machine-wide lock (jobgen.devcluster.state.global_lock)."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    owners = {n: _owner(REGISTRY / str(n)) for n in range(MAX_INSTANCES) if (REGISTRY / str(n)).exists()}
    held = [n for n, owner in owners.items() if owner == state_dir]
    free = [n for n in range(MAX_INSTANCES) if owners.get(n) is None or not alive(owners[n])]
    if not held and not free:
        raise RuntimeError(f"{MAX_INSTANCES} dev clusters are up on this machine; take one down first")
    number = held[0] if held else free[0]
    tmp = REGISTRY / f".{number}.tmp"
    tmp.write_text(f"{state_dir}\n")
    os.replace(tmp, REGISTRY / str(number))
    return Instance(number)


def release(state_dir: Path, number: int) -> None:
    """Give the number back (``down``), if the cluster in ``state_dir`` holds it."""
    entry = REGISTRY / str(number)
    if _owner(entry) == state_dir:
        entry.unlink(missing_ok=True)


def registered() -> list[Path]:
    """The state dirs of every cluster that holds a number, by number."""
    if not REGISTRY.is_dir():
        return []
    entries = sorted((e for e in REGISTRY.iterdir() if e.name.isdigit()), key=lambda e: int(e.name))
    return [owner for owner in map(_owner, entries) if owner is not None]


def others(state_dir: Path) -> list[Path]:
    """The state dirs of the other clusters that hold a number."""
    return [owner for owner in registered() if owner != state_dir]
