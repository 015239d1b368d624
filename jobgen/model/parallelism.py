"""The data-parallel strategies as jobgen knows them before anything runs: one entry per
``train.parallelism``, with what it shards and over how many ranks. The spec checks, the
memory estimate and ``jobgen plan`` read this table; the trainer's own table
(trainer/parallel/strategies.py), keyed by the same names, says how each one wraps a model.

- ``ddp``: every rank holds the whole model; gradients are all-reduced over all ranks.
- ``fsdp``: parameters, gradients and optimizer state sharded over all ranks (FSDP2,
  ``fully_shard`` on a 1-D mesh): each block's parameters are all-gathered from every rank,
  across the network on a multi-node run, twice a step.
- ``hsdp``: sharded within a group of ``shard_size`` ranks (a node by default), replicated
  across groups (FSDP2 on a 2-D mesh ``(replicate, shard)``): the all-gathers stay on the
  node's fast links and only the gradient shards cross the network, once a step.
- ``pipeline``: consecutive decoder blocks on consecutive ranks (``[train.pipeline]``),
  activations passed between them; several pipelines combine as data-parallel replicas
  (FSDP2 or replicate over each stage's copies). Only activations of the micro-batches
  cross between stages, which suits nodes joined by Ethernet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ParallelismName = Literal["ddp", "fsdp", "hsdp", "pipeline"]


@dataclass(frozen=True)
class Parallelism:
    """What one strategy shards, for the estimate and the checks."""

    name: str
    summary: str
    shards_parameters: bool  # parameters, gradients and optimizer state split over a shard group
    groups_by_node: bool  # the shard group is a part of the world (shard_size), not all of it

    def shard_size(self, world_size: int, procs_per_node: int | Sequence[int], shard_size: int | None) -> int:
        """Ranks one copy of the model is split over: 1 for DDP (each rank a whole copy).
        ``procs_per_node``: one count for every node, or each node's (job.procs_per_node as a
        list); nodes of different counts have no default group (the loader refuses that without
        train.shard_size), and the smallest node's stands in for an estimate."""
        if not self.shards_parameters:
            return 1
        if not self.groups_by_node:
            return world_size
        return min(shard_size or min(_counts(procs_per_node)), world_size)


STRATEGIES: dict[str, Parallelism] = {
    "ddp": Parallelism(
        "ddp", "DistributedDataParallel: a whole replica per rank", shards_parameters=False, groups_by_node=False
    ),
    "fsdp": Parallelism(
        "fsdp", "FSDP2: parameters, gradients and optimizer state sharded over every rank", True, False
    ),
    "hsdp": Parallelism(
        "hsdp", "FSDP2 on a 2-D mesh: sharded within a node (shard_size ranks), replicated across nodes", True, True
    ),
    # Built on meta, each rank reading its stages' tensors; the memory plan splits by stage.
    "pipeline": Parallelism(
        "pipeline", "pipeline stages over ranks (train.pipeline), replicas combined by FSDP2", True, False
    ),
}


def strategy(name: str) -> Parallelism:
    return STRATEGIES[name]


def _counts(procs_per_node: int | Sequence[int]) -> tuple[int, ...]:
    return (procs_per_node,) if isinstance(procs_per_node, int) else tuple(procs_per_node)


def shard_size_problem(
    name: str, world_size: int, procs_per_node: int | Sequence[int], shard_size: int | None
) -> str | None:
    """Why ``train.shard_size`` does not fit this world (None when it does). ``procs_per_node``:
    one count for every node, or each node's (job.procs_per_node as a list). (A shard_size
    without hsdp is refused by TrainSpec itself.)"""
    if name != "hsdp":
        return None
    counts = _counts(procs_per_node)
    if len(set(counts)) > 1:
        return _unequal_nodes_problem(list(counts), shard_size)
    size = shard_size or counts[0]
    if size > world_size or world_size % size:
        source = "train.shard_size" if shard_size else "the processes per node (train.shard_size unset)"
        return (
            f"hsdp shards within groups of {size} ranks ({source}), which must divide the world size "
            f"{world_size} (job.nodes x job.procs_per_node)"
        )
    return None


def _unequal_nodes_problem(counts: list[int], shard_size: int | None) -> str | None:
    """Nodes of different process counts: a shard group is ``shard_size`` consecutive ranks,
    and each node's ranks are consecutive, so groups stay on one node (the point of hsdp) only
    when the size divides every node's count (and then the world, their sum)."""
    if shard_size is None:
        return (
            f"hsdp shards within a node by default, and the nodes run different numbers of processes "
            f"(job.procs_per_node = {counts}): set train.shard_size to a size that divides every entry"
        )
    if any(count % shard_size for count in counts):
        return (
            f"hsdp shards within groups of {shard_size} ranks (train.shard_size), which must divide every "
            f"node's processes (job.procs_per_node = {counts}) so that no group spans two nodes"
        )
    return None
