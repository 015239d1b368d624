"""The world as a run lays it out: one mesh of independent degrees, built once from the spec
and a world size (:func:`mesh_of`; ``TrainSpec.mesh``) and read by the spec's checks, the
memory plan and the trainer's device meshes, instead of each of them reading
``train.context_parallel``, ``train.pipeline.size`` and ``train.shard_size`` on its own.

    pp         pipeline positions (train.pipeline.size; 1 without a pipeline)
    replicate  copies of each position's states; their gradients are all-reduced
    shard      ranks each copy's states are sharded over (1: whole copies, as DDP keeps them)
    cp         consecutive data-parallel ranks that read the same rows, each a share of every
               row (train.context_parallel)
    ep         consecutive data-parallel ranks that hold different experts of each MoE layer,
               each reading its own rows (train.expert_parallel)

``world = pp x replicate x shard``, and ``cp`` and ``ep`` divide ``dp = replicate x shard``, the
data-parallel ranks of one position. As in torchtitan's ParallelDims
(torchtitan/distributed/parallel_dims.py: pp, dp_replicate, dp_shard, cp, tp), ranks are
numbered row-major with the pipeline outermost: rank ``r`` is at position ``r // dp`` and is
data-parallel rank ``r % dp`` there, the states' shard group is ``shard`` consecutive ranks,
and a context group ``cp`` consecutive ranks. Unlike torchtitan, whose FSDP shards over
``dp_shard x cp`` flattened (so a context group lies inside a shard group), ``cp`` here is a
second factoring of the same ``dp`` ranks beside ``(replicate, shard)``: the states are split
over every data-parallel rank, context ranks included (their gradients are averaged like
replicas'), and a context group may span hsdp's node-sized shard groups (a context group over
two nodes of two GPUs each). That is how the trainer has always grouped them.

The context-parallel degree's refusals live here with it (:data:`CONTEXT_PARALLEL_REFUSES`);
a parallelism that cannot take one says so in its entry (``Parallelism.context_parallel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jobgen.model.parallelism import EVAL, LOSS_CHUNKS, STRATEGIES, ModelRefusal, Parallelism, Refusal
from jobgen.model.traits import ModelTraits

# Why a context-parallel rank cannot do what needs whole rows.
_SHARES = "each rank holds a share of every row, which the pipeline's schedule and the chunked loss do not split"

# In the order the spec checks them: TrainSpec's own settings first, then the run's.
CONTEXT_PARALLEL_REFUSES = (
    Refusal(
        (LOSS_CHUNKS,),
        "train.context_parallel = {context_parallel} cannot be combined with train.loss_chunk_tokens yet: " + _SHARES,
    ),
    Refusal(
        (EVAL,), "[eval] cannot be combined with train.context_parallel yet: evaluation runs whole rows on each rank"
    ),
)


# The architectures context parallelism cannot split: it splits attention, and these mix the
# sequence otherwise too. Said by validate for a local model and by the trainer as it builds one.
CONTEXT_PARALLEL_REFUSES_MODELS = (
    ModelRefusal(
        lambda traits: traits.recurrent,
        "the model's '{model_type}' layers include sequence mixers that are no attention (Mamba scans, linear "
        "attention), which would run on each rank's share of a row as if it were the whole row: context "
        "parallelism splits attention only. Train it with train.context_parallel = 1 (ddp, fsdp or hsdp; "
        "expert_parallel for its experts); for long rows, train.loss_chunk_tokens and checkpointing",
    ),
    ModelRefusal(
        lambda traits: traits.attention_sinks,
        "the model's attention has learned sinks ('{model_type}'), which the context-parallel attention does not "
        "compute: train it with train.context_parallel = 1 (ddp, fsdp or hsdp; expert_parallel for its experts)",
    ),
)


def context_parallel_model_refusal(degree: int, traits: ModelTraits) -> str | None:
    """Why ``train.context_parallel = degree`` cannot train a model of ``traits``; None when it
    can, and always for a degree of 1."""
    if degree == 1:
        return None
    return next((r.text(traits) for r in CONTEXT_PARALLEL_REFUSES_MODELS if r.applies(traits)), None)


@dataclass(frozen=True)
class Mesh:
    """The degrees of one world's layout (see the module docstring)."""

    pp: int = 1
    replicate: int = 1
    shard: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks of one pipeline position."""
        return self.replicate * self.shard

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def data_replicas(self) -> int:
        """Groups of ranks that read different rows: the data sampler's shards."""
        return self.dp // self.cp

    @property
    def ranks_per_replica(self) -> int:
        """Ranks that read the same rows: a whole pipeline, or a context-parallel group."""
        return self.pp * self.cp

    def data_shard(self, rank: int) -> tuple[int, int]:
        """(shard, shards) of the data sampler for ``rank``: its position's data-parallel rank
        over the context group's size."""
        return (rank % self.dp) // self.cp, self.data_replicas

    def position(self, rank: int) -> tuple[int, int]:
        """(pipeline position, data-parallel rank in it) of ``rank``."""
        return rank // self.dp, rank % self.dp


def mesh_of(
    parallelism: str,
    world_size: int,
    procs_per_node: int | Sequence[int],
    *,
    shard_size: int | None = None,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    pipeline_size: int | None = None,
    data_parallel: str | None = None,
) -> Mesh:
    """The mesh of a world of ``world_size`` ranks that the loader (or the trainer, for the
    world torchrun formed) found the layout fits: ``parallelism``'s entry says whether the
    world is split into pipeline positions (``pipeline_size`` ranks each, default the world)
    and, for a pipeline, ``data_parallel`` (train.pipeline.data_parallel's entry) how the
    positions' replicas hold the states. ``procs_per_node``: one count for every node, or
    each node's (hsdp's default shard group is a node)."""
    entry = STRATEGIES[parallelism]
    pp = (pipeline_size or world_size) if entry.pipelined else 1
    dp = max(1, world_size // pp)  # a layout the checks refuse is no reason to divide by zero
    holds_states = STRATEGIES[data_parallel] if entry.pipelined and data_parallel else entry
    shard = holds_states.shard_size(dp, procs_per_node, shard_size)
    return Mesh(pp=pp, replicate=dp // shard, shard=shard, cp=context_parallel, ep=expert_parallel)


def context_parallel_problem(strategy: Parallelism, degree: int, on: frozenset[str]) -> str | None:
    """Why ``train.context_parallel = degree`` cannot run with ``strategy`` and the settings
    ``on`` (what the caller sees of them, as :meth:`Parallelism.refusal` takes them); None when
    it can, and always for a degree of 1."""
    if degree == 1:
        return None
    if not strategy.context_parallel:
        return (
            f"train.context_parallel = {degree} cannot be combined with train.parallelism = '{strategy.name}' yet: "
            + _SHARES
        )
    refusal = next((r for r in CONTEXT_PARALLEL_REFUSES if r.applies(on)), None)
    return refusal.text(context_parallel=degree) if refusal else None
