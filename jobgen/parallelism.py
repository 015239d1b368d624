"""The data-parallel strategies as jobgen knows them before anything runs: one entry per
``train.parallelism``, with what it shards and over how many ranks. The spec checks, the
memory estimate and ``jobgen plan`` read this table; the trainer's own table
(trainer/parallel.py), keyed by the same names, says how each one wraps a model.

- ``ddp``: every rank holds the whole model; gradients are all-reduced over all ranks.
- ``fsdp``: parameters, gradients and optimizer state sharded over all ranks (FSDP2,
  ``fully_shard`` on a 1-D mesh): each block's parameters are all-gathered from every rank,
  across the network on a multi-node run, twice a step.
- ``hsdp``: sharded within a group of ``shard_size`` ranks (a node by default), replicated
  across groups (FSDP2 on a 2-D mesh ``(replicate, shard)``): the all-gathers stay on the
  node's fast links and only the gradient shards cross the network, once a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ParallelismName = Literal["ddp", "fsdp", "hsdp"]


@dataclass(frozen=True)
class Parallelism:
    """What one strategy shards, for the estimate and the checks."""

    name: str
    summary: str
    shards_parameters: bool  # parameters, gradients and optimizer state split over a shard group
    groups_by_node: bool  # the shard group is a part of the world (shard_size), not all of it

    def shard_size(self, world_size: int, procs_per_node: int, shard_size: int | None) -> int:
        """Ranks one copy of the model is split over: 1 for DDP (each rank a whole copy)."""
        if not self.shards_parameters:
            return 1
        if not self.groups_by_node:
            return world_size
        return min(shard_size or procs_per_node, world_size)


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
}


def strategy(name: str) -> Parallelism:
    return STRATEGIES[name]


def shard_size_problem(name: str, world_size: int, procs_per_node: int, shard_size: int | None) -> str | None:
    """Why ``train.shard_size`` does not fit this world (None when it does). (A shard_size
    without hsdp is refused by TrainSpec itself.)"""
    if name != "hsdp":
        return None
    size = shard_size or procs_per_node
    if size > world_size or world_size % size:
        source = "train.shard_size" if shard_size else "the processes per node (train.shard_size unset)"
        return (
            f"hsdp shards within groups of {size} ranks ({source}), which must divide the world size "
            f"{world_size} (job.nodes x job.procs_per_node)"
        )
    return None
