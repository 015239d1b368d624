"""Pipeline parallelism as jobgen knows it before anything runs: which decoder blocks each
pipeline stage holds, which stages each pipeline rank holds, and what each schedule asks of
``train.pipeline.*``. Pure Python (no torch): the spec checks, ``jobgen plan`` and the
trainer (trainer/parallel/pipeline.py) read the same rules.

- :func:`stage_layers`: contiguous block ranges per stage. The first stage also holds the
  input embedding and the last the final norm and output layer, so by default each of them
  counts as ``embed_weight`` / ``head_weight`` blocks (the caller passes the ratio of their
  parameters to a block's), and a stage on a smaller device (``capacities``) gets
  proportionally fewer blocks.
- :func:`stage_indices`: torch's placement of stages on ranks, "loop" (stage ``s`` on rank
  ``s % pp``) or "v" (rank ``r`` holds ``r`` and ``2 pp - 1 - r``).
- :data:`SCHEDULES` and :func:`schedule_problem`: jobgen's schedule names, torch's class
  names (``torch.distributed.pipelining.get_schedule_class``) and their constraints on the
  number of stages and micro-batches, as torch 2.13 checks them (or, for zbv-zero-bubble,
  as its schedule assumes without checking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from jobgen.model.mesh import Mesh

STAGES_KEY = "train.pipeline.stages"
LAYERS_KEY = "train.pipeline.layers_per_stage"
SCHEDULE_KEY = "train.pipeline.schedule"
MICROBATCHES_KEY = "train.pipeline.microbatches"

# Loads closer than this are a tie, broken towards the earlier stage (weights are floats).
_TIE = 1e-9


class PipelineSplitError(ValueError):
    """The model's blocks cannot be split as asked; the message names the key to change."""


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule: torch's class and what it asks of the layout."""

    name: str  # jobgen's name (train.pipeline.schedule)
    torch_name: str  # torch.distributed.pipelining.get_schedule_class's name
    placement: Literal["loop", "v"]  # which stages a rank holds (stage_indices)
    stages_per_rank: int | None  # exactly this many, or None: any whole number (stages % pp == 0)
    microbatches: Literal["any", "at_least_stages", "rounds"]  # the rule schedule_problem checks
    summary: str

    def stage_count_problem(self, pp_size: int, stages: int) -> str | None:
        """Why ``stages`` stages do not fit ``pp_size`` pipeline ranks under this schedule."""
        if self.stages_per_rank is not None and stages != self.stages_per_rank * pp_size:
            per = "one stage" if self.stages_per_rank == 1 else f"{self.stages_per_rank} stages"
            return (
                f"{SCHEDULE_KEY} = '{self.name}' runs {per} per pipeline rank: {STAGES_KEY} must be "
                f"{self.stages_per_rank * pp_size} with {pp_size} pipeline ranks, not {stages}"
            )
        if stages < pp_size or stages % pp_size:
            return (
                f"{SCHEDULE_KEY} = '{self.name}' places stage s on pipeline rank s % {pp_size}: {STAGES_KEY} "
                f"must be a multiple of the {pp_size} pipeline ranks, not {stages}"
            )
        return None


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule(
            "gpipe", "GPipe", "loop", 1, "any", "all forwards, then all backwards: simple, most activation memory"
        ),
        Schedule("1f1b", "1F1B", "loop", 1, "at_least_stages", "one forward, one backward: activations of <= pp"),
        Schedule("interleaved-1f1b", "Interleaved1F1B", "loop", None, "rounds", "1F1B over several stages per rank"),
        Schedule("looped-bfs", "LoopedBFS", "loop", None, "any", "breadth first over several stages per rank"),
        Schedule(
            "interleaved-zero-bubble",
            "InterleavedZeroBubble",
            "loop",
            None,
            "rounds",
            "interleaved 1F1B with input and weight gradients split to fill the bubble",
        ),
        Schedule("zbv-zero-bubble", "ZBVZeroBubble", "v", 2, "at_least_stages", "zero bubble, two stages per rank"),
        Schedule("dualpipev", "DualPipeV", "v", 2, "at_least_stages", "DeepSeek's DualPipe, two stages per rank"),
    )
}


def schedule(name: str) -> Schedule:
    """The schedule named ``name``; PipelineSplitError naming the key for an unknown one."""
    if name not in SCHEDULES:
        raise PipelineSplitError(f"{SCHEDULE_KEY}: unknown schedule '{name}'; one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def schedule_problem(name: str, world_pp: int, stages: int, microbatches: int) -> str | None:
    """Why schedule ``name`` cannot run ``stages`` stages on ``world_pp`` pipeline ranks with
    ``microbatches`` micro-batches per step (None when it can); the message names the keys."""
    if name not in SCHEDULES:
        return f"{SCHEDULE_KEY}: unknown schedule '{name}'; one of {', '.join(SCHEDULES)}"
    chosen = SCHEDULES[name]
    if world_pp < 1:
        return f"{STAGES_KEY}: a pipeline needs at least one rank, got {world_pp}"
    problem = chosen.stage_count_problem(world_pp, stages)
    if problem:
        return problem
    if microbatches < 1:
        return f"{MICROBATCHES_KEY} must be at least 1, not {microbatches}"
    if chosen.microbatches == "at_least_stages" and microbatches < stages:
        return (
            f"{SCHEDULE_KEY} = '{name}' needs at least as many micro-batches as stages: "
            f"{MICROBATCHES_KEY} = {microbatches} < {STAGES_KEY} = {stages}"
        )
    if chosen.microbatches == "rounds":
        # torch runs the micro-batches in rounds of microbatches // rounds, rounds = mb // pp.
        rounds = max(1, microbatches // world_pp)
        if microbatches % rounds:
            return (
                f"{SCHEDULE_KEY} = '{name}' runs the micro-batches in {rounds} rounds ({MICROBATCHES_KEY} // "
                f"{world_pp} pipeline ranks): {MICROBATCHES_KEY} = {microbatches} must be a multiple of {rounds} "
                f"(e.g. {rounds * world_pp} or {world_pp})"
            )
    return None


def stage_indices(schedule_name: str, pp_rank: int, pp_size: int, stages: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` of ``pp_size`` holds, in execution order of
    its first micro-batch: "loop" placement ``pp_rank, pp_rank + pp, ...``; "v" placement
    ``pp_rank, 2 pp - 1 - pp_rank``."""
    chosen = schedule(schedule_name)
    if not 0 <= pp_rank < pp_size:
        raise PipelineSplitError(f"pipeline rank {pp_rank} is outside 0..{pp_size - 1}")
    problem = chosen.stage_count_problem(pp_size, stages)
    if problem:
        raise PipelineSplitError(problem)
    if chosen.placement == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return list(range(pp_rank, stages, pp_size))


def stage_positions(schedule_name: str, pp_size: int, stages: int) -> list[int]:
    """The pipeline rank holding each stage, stage by stage (:func:`stage_indices` inverted)."""
    owner = {s: p for p in range(pp_size) for s in stage_indices(schedule_name, p, pp_size, stages)}
    return [owner[s] for s in range(stages)]


@dataclass(frozen=True)
class NodeMemory:
    """job.device_memory with each node's ranks, node by node: what :func:`stage_capacities` reads."""

    node_procs: tuple[int, ...]
    memory: tuple[int, ...]  # bytes


def stage_capacities(mesh: Mesh, schedule_name: str, stages: int, nodes: NodeMemory) -> list[float]:
    """Each stage's share of device memory, for :func:`stage_layers`' ``capacities``: the least
    memory among the ranks that hold it (a position's replicas all hold its stages), each rank's
    that of its node (ranks numbered node by node), relative to the largest. The trainer's split
    and ``jobgen plan``'s both come from here."""
    rank_memory = [memory for procs, memory in zip(nodes.node_procs, nodes.memory) for _ in range(procs)]
    if len(rank_memory) != mesh.world:
        raise PipelineSplitError(
            f"device memory for {len(rank_memory)} ranks (job.device_memory over job.procs_per_node), "
            f"the world is {mesh.world}"
        )
    least = [math.inf] * stages
    for rank, memory in enumerate(rank_memory):
        position, _ = mesh.position(rank)
        for stage in stage_indices(schedule_name, position, mesh.pp, stages):
            least[stage] = min(least[stage], memory)
    largest = max(least)
    return [memory / largest for memory in least]


def stage_layers(
    num_layers: int,
    stages: int,
    *,
    layers_per_stage: list[int] | None = None,
    embed_weight: float = 1.0,
    head_weight: float = 1.0,
    capacities: list[float] | None = None,
) -> list[range]:
    """The contiguous decoder-block range of each of ``stages`` stages.

    ``layers_per_stage`` given: checked (one count >= 1 per stage, summing to ``num_layers``)
    and used as is. Otherwise balanced: a stage's load is its blocks, plus ``embed_weight`` on
    the first and ``head_weight`` on the last, divided by its ``capacity`` (relative device
    memory, default equal); the split minimises the largest load, ties going to the earlier
    stage (with weights of 1 this is torchtitan's split). Every stage gets at least one block.
    """
    if stages < 1:
        raise PipelineSplitError(f"{STAGES_KEY} must be at least 1, not {stages}")
    if stages > num_layers:
        raise PipelineSplitError(
            f"{STAGES_KEY} = {stages} is more than the model's {num_layers} decoder blocks: "
            "every stage needs at least one block"
        )
    if layers_per_stage is not None:
        counts = _checked_counts(num_layers, stages, layers_per_stage)
    else:
        counts = _balanced_counts(
            num_layers, _extras(stages, embed_weight, head_weight), _capacities(stages, capacities)
        )
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def _checked_counts(num_layers: int, stages: int, counts: list[int]) -> list[int]:
    if len(counts) != stages:
        raise PipelineSplitError(
            f"{LAYERS_KEY} has {len(counts)} entries and {STAGES_KEY} is {stages}: give one block count per stage"
        )
    if any(n < 1 for n in counts):
        raise PipelineSplitError(f"{LAYERS_KEY} = {counts}: every stage needs at least one block")
    if sum(counts) != num_layers:
        raise PipelineSplitError(
            f"{LAYERS_KEY} = {counts} sums to {sum(counts)}; the model has {num_layers} decoder blocks"
        )
    return list(counts)


def _extras(stages: int, embed_weight: float, head_weight: float) -> list[float]:
    """What each stage holds besides its blocks, in blocks: the embedding, the norm and head."""
    if embed_weight < 0 or head_weight < 0:
        raise PipelineSplitError(f"embedding and head weights must be >= 0, got {embed_weight}, {head_weight}")
    extras = [0.0] * stages
    extras[0] += embed_weight
    extras[-1] += head_weight
    return extras


def _capacities(stages: int, capacities: list[float] | None) -> list[float]:
    if capacities is None:
        return [1.0] * stages
    if len(capacities) != stages:
        raise PipelineSplitError(
            f"{len(capacities)} device capacities for {STAGES_KEY} = {stages} stages: give one per stage"
        )
    if any(c <= 0 for c in capacities):
        raise PipelineSplitError(f"device capacities must be positive, got {capacities} for the {STAGES_KEY} stages")
    return [float(c) for c in capacities]


def _balanced_counts(num_layers: int, extras: list[float], capacities: list[float]) -> list[int]:
    """One block per stage, then each further block where the resulting load is smallest:
    with loads that grow with the blocks, this greedy fill minimises the largest load."""
    counts = [1] * len(extras)
    for _ in range(num_layers - len(extras)):
        loads = [(n + 1 + extra) / cap for n, extra, cap in zip(counts, extras, capacities)]
        lowest = min(loads)
        chosen = next(s for s, load in enumerate(loads) if load <= lowest + _TIE)
        counts[chosen] += 1
    return counts
