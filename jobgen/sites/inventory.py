"""What Slurm says of a cluster's partitions and nodes, as typed records: the facts a site profile
is written from.

Pure functions of the records :func:`jobgen.slurm.text.parse_records` makes of ``scontrol show
partition --oneliner`` and ``scontrol show node --oneliner`` (what :func:`jobgen.slurm.client.partitions`
and :func:`jobgen.slurm.client.nodes` return), so that unit tests feed them captured text;
:func:`read_inventory` alone asks Slurm, through the client. A value Slurm would never print (a
CPU count that is no number, a GPU count that is no count) is an :class:`InventoryError` naming
the node or partition and the key, never a KeyError's traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jobgen.base.durations import DurationError, parse_slurm_limit

# What scontrol prints for "nothing here" (AvailableFeatures, Gres, Partitions, Nodes).
NULL = "(null)"


class InventoryError(ValueError):
    """A record of Slurm's that cannot be read: the message names the node or partition and the key."""


class NoSuchPartition(InventoryError):
    """A partition that was asked for (or needed) and is not there; the message lists the partitions."""


@dataclass(frozen=True)
class Partition:
    """One partition as ``scontrol show partition`` describes it."""

    name: str
    default: bool  # Default=YES: where a job that names no partition goes
    max_time: int | None  # MaxTime in seconds; None for UNLIMITED
    nodes: str  # Slurm's hostlist expression (node[1-4,7]); "" for none
    state: str  # UP, DOWN, DRAIN or INACTIVE: a partition that is not UP is kept, and says so
    hidden: bool = False  # Hidden=YES: listed only for `scontrol show partition --all`


@dataclass(frozen=True)
class Node:
    """One node as ``scontrol show node`` describes it."""

    name: str
    cpus: int  # CPUTot
    real_memory_mb: int  # RealMemory: what Slurm lets jobs on this node use, in MB
    gpus: int  # every `gpu` entry of Gres summed; other gres (shard, mps, ...) are not GPUs
    gpu_type: str | None  # the type of its GPUs when every gpu entry names the same one
    features: tuple[str, ...]  # AvailableFeatures (what --constraint matches)
    partitions: tuple[str, ...]  # empty for a node in no partition
    # CPUEfctv: CPUTot less the cores Slurm keeps for its daemons (CoreSpecCount), what a job
    # can have; Slurm before 22.05 prints no CPUEfctv, and there it is CPUTot.
    usable_cpus: int = 0

    def __post_init__(self) -> None:
        if not self.usable_cpus:
            object.__setattr__(self, "usable_cpus", self.cpus)


@dataclass(frozen=True)
class Shape:
    """One kind of machine in a partition: the nodes that have the same GPUs, CPUs and memory."""

    gpus: int
    cpus: int  # the CPUs a job can have on each (Node.usable_cpus)
    memory_mb: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Inventory:
    """The cluster as Slurm describes it: its partitions and nodes, and the version of its client."""

    partitions: tuple[Partition, ...]
    nodes: tuple[Node, ...]
    slurm_version: str  # "22.05.8"

    @property
    def default_partition(self) -> Partition | None:
        return next((p for p in self.partitions if p.default), None)

    def partition(self, name: str) -> Partition:
        """The partition called ``name``; :class:`NoSuchPartition` listing them all when none is."""
        for partition in self.partitions:
            if partition.name == name:
                return partition
        raise NoSuchPartition(f"no partition '{name}' on this cluster; its partitions: {self.partition_names()}")

    def partition_names(self) -> str:
        return ", ".join(p.name for p in self.partitions) or "none"

    def nodes_of(self, partition: str) -> tuple[Node, ...]:
        """The nodes whose Partitions field names ``partition``, in Slurm's order. By the node
        records rather than the partition's hostlist: expanding node[1-4,7] is Slurm's job
        (scontrol show hostnames), and the node records already say it."""
        return tuple(n for n in self.nodes if partition in n.partitions)

    def shapes(self, partition: str) -> tuple[Shape, ...]:
        """The distinct (GPUs, CPUs, memory) of a partition's nodes, each with its nodes, in the
        order their first node comes."""
        grouped: dict[tuple[int, int, int], list[str]] = {}
        for node in self.nodes_of(partition):
            grouped.setdefault((node.gpus, node.usable_cpus, node.real_memory_mb), []).append(node.name)
        return tuple(Shape(g, c, m, tuple(names)) for (g, c, m), names in grouped.items())

    def choose_partition(self, wanted: str | None) -> Partition:
        """The partition a profile is for: ``wanted`` when given (it must exist), else the
        cluster's default, else the only one. Anything else is :class:`NoSuchPartition` listing
        the partitions to choose from with ``--partition``."""
        if wanted is not None:
            return self.partition(wanted)
        if self.default_partition is not None:
            return self.default_partition
        if len(self.partitions) == 1:
            return self.partitions[0]
        if not self.partitions:
            raise NoSuchPartition("Slurm lists no partition on this cluster")
        raise NoSuchPartition(
            f"this cluster has no default partition; choose one with --partition: {self.partition_names()}"
        )


# ---------------------------------------------------------------- records to types


def _required(record: dict[str, str], key: str, what: str) -> str:
    value = record.get(key)
    if value is None:
        raise InventoryError(f"{what}: Slurm's record has no {key}")
    return value


def _count(value: str, what: str, key: str) -> int:
    """A whole number Slurm printed (CPUTot=4, RealMemory=4096)."""
    if not value.strip().isdigit():
        raise InventoryError(f"{what}: {key}={value!r} is not a whole number")
    return int(value)


def _list(value: str | None) -> tuple[str, ...]:
    """A comma-separated field (Partitions=debug,short); "(null)", empty or absent is none."""
    if value is None or value.strip() in ("", NULL):
        return ()
    return tuple(item.strip() for item in value.split(",") if item.strip())


def partition_from(record: dict[str, str]) -> Partition:
    """One ``scontrol show partition --oneliner`` record."""
    name = record.get("PartitionName", "").strip()
    if not name:
        raise InventoryError(f"a partition record without PartitionName: {sorted(record)}")
    what = f"partition '{name}'"
    max_time = record.get("MaxTime", "UNLIMITED")
    try:
        seconds = parse_slurm_limit(max_time)
    except DurationError:
        raise InventoryError(f"{what}: MaxTime={max_time!r} is not a time limit") from None
    nodes = record.get("Nodes", "").strip()
    return Partition(
        name=name,
        default=record.get("Default", "NO").upper() == "YES",
        max_time=seconds,
        nodes="" if nodes == NULL else nodes,
        state=record.get("State", "UNKNOWN").strip() or "UNKNOWN",
        hidden=record.get("Hidden", "NO").upper() == "YES",
    )


# One gres entry: name, then an optional type, then an optional count (a bare name is one of
# it, as in slurm.conf), then an optional (S:0-1) / (IDX:0,1) of where they sit.
_GRES_ENTRY = re.compile(r"^(?P<name>[^:()]+)(?::(?P<rest>[^()]*))?(?:\(.*\))?$")


def _gres_entries(gres: str) -> list[str]:
    """Gres=gpu:h100:4(S:0,1),shard:8 split at the commas outside parentheses: a socket list
    (S:0,1) holds commas of its own."""
    entries, depth, current = [], 0, ""
    for char in gres:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    return [e.strip() for e in [*entries, current] if e.strip()]


def _gpu_entry(entry: str, what: str) -> tuple[int, str | None] | None:
    """(count, type) of one gres entry when it is a gpu, None for any other gres."""
    match = _GRES_ENTRY.match(entry)
    if match is None:
        raise InventoryError(f"{what}: Gres entry {entry!r} is not name[:type][:count]")
    if match.group("name") != "gpu":
        return None
    fields = match.group("rest").split(":") if match.group("rest") else []
    if len(fields) > 2 or any(not f for f in fields):
        raise InventoryError(f"{what}: Gres entry {entry!r} is not gpu[:type][:count]")
    if fields and fields[-1].isdigit():
        return int(fields[-1]), (fields[0] if len(fields) == 2 else None)
    if len(fields) == 2:  # gpu:h100:x: a type and something that is no count
        raise InventoryError(f"{what}: Gres entry {entry!r} has no GPU count")
    return 1, (fields[0] if fields else None)  # gpu or gpu:h100: one of them


def gpus_of(gres: str, what: str = "node") -> tuple[int, str | None]:
    """(GPU count, the type when every gpu entry names the same one) of a node's Gres, e.g.
    ``gpu:3``, ``gpu:h100:8(S:0-1)``, ``gpu:h100:4,gpu:a100:2``, ``gpu:a100:4,shard:8``, ``(null)``."""
    found = [g for g in (_gpu_entry(e, what) for e in _gres_entries(gres) if e != NULL) if g is not None]
    types = {kind for _, kind in found}
    return sum(count for count, _ in found), (types.pop() if len(types) == 1 else None)


def node_from(record: dict[str, str]) -> Node:
    """One ``scontrol show node --oneliner`` record."""
    name = record.get("NodeName", "").strip()
    if not name:
        raise InventoryError(f"a node record without NodeName: {sorted(record)}")
    what = f"node '{name}'"
    # CPUTot is what Slurm knows the node has; a record without it (none seen, but a cloud
    # node not yet registered could lack it) still says CPUEfctv, what a job can have.
    key = "CPUEfctv" if "CPUTot" not in record and "CPUEfctv" in record else "CPUTot"
    cpus = _count(_required(record, key, what), what, key)
    usable = record.get("CPUEfctv")
    gpus, gpu_type = gpus_of(record.get("Gres", NULL), what)
    return Node(
        name=name,
        cpus=cpus,
        real_memory_mb=_count(_required(record, "RealMemory", what), what, "RealMemory"),
        gpus=gpus,
        gpu_type=gpu_type,
        features=_list(record.get("AvailableFeatures")),
        partitions=_list(record.get("Partitions")),
        usable_cpus=_count(usable, what, "CPUEfctv") if usable is not None else cpus,
    )


def inventory_from(
    partition_records: list[dict[str, str]], node_records: list[dict[str, str]], slurm_version: str
) -> Inventory:
    """The inventory of the records Slurm printed."""
    return Inventory(
        partitions=tuple(partition_from(r) for r in partition_records),
        nodes=tuple(node_from(r) for r in node_records),
        slurm_version=slurm_version,
    )


def read_inventory() -> Inventory:
    """Ask the cluster (three scontrol/sbatch calls through :mod:`jobgen.slurm.client`, the one
    place that runs Slurm's commands). Raises the client's SlurmError / SlurmUnavailable when
    Slurm does not answer, InventoryError when what it says cannot be read."""
    from jobgen.slurm import client

    # Slurm's versions are year.month.patch, the month written with two digits (22.05.8).
    version = ".".join(f"{part:02d}" if i == 1 else str(part) for i, part in enumerate(client.version()))
    return inventory_from(client.partitions(), client.nodes(), version)
