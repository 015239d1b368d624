"""The parallelisms as jobgen knows them before anything runs: one entry per
``train.parallelism``, with what it shards and over how many ranks, the settings it refuses
and what the planner may change about it. The spec's validators, the memory estimate and
``jobgen plan`` read this table, and so does the trainer, whose own table
(trainer/parallel/strategies.py), keyed by the same names, says how each one wraps a model.
No other module branches on a parallelism's name (tests/unit/test_dispatch_tables.py).

- ``ddp``: every rank holds the whole model; gradients are all-reduced over all ranks.
- ``fsdp``: parameters, gradients and optimizer state sharded over all ranks (FSDP2,
  ``fully_shard`` on a 1-D mesh): each block's parameters are all-gathered from every rank,
  across the network on a multi-node run, twice a step.
- ``hsdp``: sharded within a group of ``shard_size`` ranks (a node by default), replicated
  across groups (FSDP2 on a 2-D mesh ``(replicate, shard)``): the all-gathers stay on the
  node's fast links and only the gradient shards cross the network, once a step.
- ``pipeline``: consecutive decoder blocks on consecutive ranks (``[train.pipeline]``),
  activations passed between them; several pipelines combine as data-parallel replicas
  (FSDP2 or replicate over each stage's copies, ``train.pipeline.data_parallel``: an entry of
  this table too). Only activations of the micro-batches cross between stages, which suits
  nodes joined by Ethernet.

Refused settings. What a run turns on that some parallelism cannot run with is named by the
key that turns it on (the constants below); the spec (jobgen.spec.tables: TrainSpec.turned_on,
RunSpec.turned_on) and the plan (jobgen.plan.inputs.PlanInputs.turned_on) each say which of
them a run has on, and :meth:`Parallelism.refusal` which one the entry refuses, with the
spec's message. The context-parallel degree's own refusals are
:data:`jobgen.model.mesh.CONTEXT_PARALLEL_REFUSES`.

Refused models. What an entry cannot train of an architecture (jobgen.model.traits: a family
the pipeline's stages do not build, tied embeddings) is its
``refuses_models``: ``jobgen validate`` says it of a local model, the trainer of any model
before it loads one (trainer.model.build.refuse_unsupported).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from jobgen.model.traits import ModelTraits

ParallelismName = Literal["ddp", "fsdp", "hsdp", "pipeline"]

# What a run can turn on that a parallelism may refuse, by the key (or words) that turn it on.
CPU_OFFLOAD = "train.cpu_offload"
IN_BACKWARD = "train.optimizer_in_backward"
LOSS_CHUNKS = "train.loss_chunk_tokens"
PER_PARAMETER_CLIP = "train.grad_clip_mode = 'per_parameter'"
EVAL = "[eval]"
LORA = "model.lora"
ACTIVATION_OFFLOADING = "model.activation_offloading"
SEVERAL_PROCESSES = "more than one process"  # job.nodes x job.procs_per_node above 1


@dataclass(frozen=True)
class Refusal:
    """Settings a parallelism cannot run with, all on together, and what the spec says of them."""

    keys: tuple[str, ...]
    message: str  # str.format fields: the values the spec has (nodes, procs_per_node)

    def applies(self, on: frozenset[str]) -> bool:
        return set(self.keys) <= on

    def text(self, **values: object) -> str:
        return self.message.format(**values) if values else self.message


@dataclass(frozen=True)
class ModelRefusal:
    """An architecture a parallelism cannot train (jobgen.model.traits), and why: said by
    ``jobgen validate`` for a local model and by the trainer as it builds one."""

    applies: Callable[[ModelTraits], bool]
    message: str  # str.format fields: model_type

    def text(self, traits: ModelTraits) -> str:
        return self.message.format(model_type=traits.model_type)


@dataclass(frozen=True)
class Parallelism:
    """What one strategy shards and refuses, for the checks, the estimate and the plan."""

    name: str
    summary: str
    shards_parameters: bool  # parameters, gradients and optimizer state split over a shard group
    groups_by_node: bool  # the shard group is a part of the world (shard_size), not all of it
    pipelined: bool = False  # stages over ranks ([train.pipeline]); estimated position by position
    context_parallel: bool = True  # takes train.context_parallel above 1
    expert_parallel: bool = False  # takes train.expert_parallel above 1 (the experts' own FSDP units)
    refuses: tuple[Refusal, ...] = ()
    # What jobgen plan suggests instead to a run that does not fit: strategies that shard the
    # states over more ranks, the least communication first (jobgen.plan.suggestions).
    instead: tuple[str, ...] = ()
    refuses_models: tuple[ModelRefusal, ...] = ()

    def model_refusal(self, traits: ModelTraits) -> str | None:
        """Why this strategy cannot train a model of ``traits`` (the first reason) and which
        strategies can, or None."""
        reason = self._reason(traits)
        if reason is None:
            return None
        able = [f"'{entry.name}'" for entry in STRATEGIES.values() if entry._reason(traits) is None]
        return f"{reason}: train it with train.parallelism = {' or '.join(able)}" if able else reason

    def _reason(self, traits: ModelTraits) -> str | None:
        return next((refusal.text(traits) for refusal in self.refuses_models if refusal.applies(traits)), None)

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

    def refusal(self, on: frozenset[str]) -> Refusal | None:
        """The first of this strategy's refusals whose settings are all ``on``; None when it
        runs with them. A caller that sees only some settings (TrainSpec without the run's
        [eval]) passes those: a refusal naming another is not its to make."""
        return next((refusal for refusal in self.refuses if refusal.applies(on)), None)


def _inside_schedule(key: str) -> Refusal:
    return Refusal(
        (key,),
        f"{key} cannot be combined with train.parallelism = 'pipeline': the last stage computes the loss inside "
        "the schedule, and each stage steps its own optimizer after the schedule",
    )


def _full_fine_tuning_only(key: str) -> Refusal:
    return Refusal(
        (key,),
        f"{key} cannot be combined with train.parallelism = 'pipeline' yet: the pipeline's stages run the full "
        f"fine-tuning forward and backward inside torch's schedule only; use 'fsdp' or 'hsdp' for a run with {key}",
    )


# In the order the spec checks them: TrainSpec's own settings first, then the run's.
PIPELINE_REFUSES = (
    _inside_schedule(CPU_OFFLOAD),
    _inside_schedule(IN_BACKWARD),
    _inside_schedule(LOSS_CHUNKS),
    # The pipeline's step clips by the whole model's norm, summed over its stages.
    Refusal(
        (PER_PARAMETER_CLIP,),
        "train.grad_clip_mode = 'per_parameter' cannot be combined with train.parallelism = 'pipeline' yet: a "
        "pipeline clips by the global gradient norm; set grad_clip_mode = 'global' or grad_clip = 0",
    ),
    _full_fine_tuning_only(LORA),
    _full_fine_tuning_only(ACTIVATION_OFFLOADING),
)

# The model types whose base model a pipeline stage runs as transformers does, piece by piece
# (trainer.parallel.pipeline_parts: embedding, absolute positions, masks by kind of layer, rotary
# positions, blocks, final norm, head, soft-capping), each proven in CI against one process
# (tests/distributed/test_family_matrix.py). Another would train silently wrong where its base
# model does something else (Granite's multipliers, Cohere's logit scale), so it is refused.
PIPELINE_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "gpt_neox",
    "gpt2",
    "smollm3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "gpt_oss",
)
PIPELINE_REFUSES_MODELS = (
    ModelRefusal(
        lambda traits: traits.router_aux_loss,
        "the model's config asks for the router's auxiliary loss (output_router_logits with router_aux_loss_coef), "
        "which a pipeline's stages do not collect across the blocks yet (set output_router_logits false in "
        "config.json to train without it)",
    ),
    ModelRefusal(
        lambda traits: traits.recurrent,
        "the model's '{model_type}' layers include Mamba scans, whose masks and states a pipeline stage does not "
        "build yet",
    ),
    ModelRefusal(
        lambda traits: traits.model_type not in PIPELINE_MODEL_TYPES,
        "pipeline parallelism trains the model types " + ", ".join(PIPELINE_MODEL_TYPES) + ", not '{model_type}' "
        "(a stage runs the base model's pieces as transformers does for these)",
    ),
)
DDP_REFUSES = (
    Refusal(
        (CPU_OFFLOAD,),
        "train.cpu_offload = true needs train.parallelism = 'fsdp' or 'hsdp': DDP keeps the whole model on every GPU",
    ),
    # DDP's gradient hooks fire before its all-reduce: one process only.
    Refusal(
        (IN_BACKWARD, SEVERAL_PROCESSES),
        "train.optimizer_in_backward = true with train.parallelism = 'ddp' runs on one process only: set "
        "job.nodes = 1 (it is {nodes}) and job.procs_per_node = 1 (it is {procs_per_node}), or use "
        "train.parallelism = 'fsdp'. DDP's gradient hooks fire before its all-reduce, so each rank would step on "
        "its own gradient and the replicas would drift apart",
    ),
)

STRATEGIES: dict[str, Parallelism] = {
    "ddp": Parallelism(
        "ddp",
        "DistributedDataParallel: a whole replica per rank",
        shards_parameters=False,
        groups_by_node=False,
        refuses=DDP_REFUSES,
        instead=("hsdp", "fsdp"),
    ),
    "fsdp": Parallelism(
        "fsdp",
        "FSDP2: parameters, gradients and optimizer state sharded over every rank",
        True,
        False,
        expert_parallel=True,
    ),
    "hsdp": Parallelism(
        "hsdp",
        "FSDP2 on a 2-D mesh: sharded within a node (shard_size ranks), replicated across nodes",
        True,
        True,
        instead=("fsdp",),
    ),
    # Built on meta, each rank reading its stages' tensors; the memory plan splits by stage.
    "pipeline": Parallelism(
        "pipeline",
        "pipeline stages over ranks (train.pipeline), replicas combined by FSDP2",
        True,
        False,
        pipelined=True,
        context_parallel=False,
        refuses=PIPELINE_REFUSES,
        refuses_models=PIPELINE_REFUSES_MODELS,
    ),
}
assert tuple(STRATEGIES) == ParallelismName.__args__, "one entry per train.parallelism"
assert all(STRATEGIES[other].shards_parameters for entry in STRATEGIES.values() for other in entry.instead)


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
    if not STRATEGIES[name].groups_by_node:
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
