"""Pipeline parallelism: each pipeline rank holds a contiguous run of decoder blocks (one or
two *stages*) and torch.distributed.pipelining's schedules pass activations between ranks.

    module, stages = build_stages(path, None, env, stage_layers(L, n), my_stages, dtype, pp_group, dp_mesh, "fsdp")
    step = PipelineStep("1f1b", stages, n_microbatches)
    loss_sum = step(input_ids, position_ids, labels, scale=dp_size / global_targets)
    grad_norm = grad_norm_and_clip(module, max_norm, pp_group)

What is decided here and why:

- :class:`StageModule` holds *all* of a rank's stages and keeps the full model's parameter
  names (``model.layers.<global index>....``, ``lm_head.weight``), so the Hugging Face
  safetensors, torch.distributed.checkpoint and an unpipelined model see the same keys: a
  checkpoint does not depend on the layout. torch runs each stage through
  :meth:`StageModule.stage_view`, a module sharing the StageModule's submodules.
- The data-parallel dimension wraps every block and every stage view with FSDP2's
  ``fully_shard`` or with ``replicate_with_fsdp.replicate`` (a DDP built on FSDP2), never
  ``nn.parallel.DistributedDataParallel``: under pipelining its reducer crashes on the second
  step or, with the zero-bubble schedules, silently skips the gradient all-reduce.
- Loss normalisation is the caller's, as in trainer.loop: the schedule's loss is the token-
  summed loss times ``scale`` (data-parallel size / target tokens of the global batch), with
  ``scale_grads=False``; torch's default (the mean of per-micro-batch means) weights tokens
  unequally.
- The schedules fix their activation shapes at the first step; :class:`PipelineStep` makes
  every rank infer them again when any rank's batch shape changed.
- Tied input/output embeddings live on the first and the last stage: each rank holds a copy,
  read from the embedding's tensor, and trainer.parallel.pipeline_steps.TiedCopies sums their
  gradients every step (the norm counts the weight once), so the copies stay one weight.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from jobgen.model.parallelism import STRATEGIES
from jobgen.model.pipeline_split import SCHEDULES, schedule_problem
from trainer.data.packing import token_loss_sum
from trainer.distributed import DistEnv
from trainer.model.errors import ModelError
from trainer.parallel.pipeline_parts import ModelParts, StageView

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage

log = logging.getLogger("trainer.parallel.pipeline")

# How a pipeline's replicas may combine: every strategy of jobgen.model.parallelism but a pipeline.
DATA_PARALLEL = tuple(name for name, entry in STRATEGIES.items() if not entry.pipelined)
PIPELINED = next(entry for entry in STRATEGIES.values() if entry.pipelined)

# The flags torch 2.13's schedules keep to run shape inference once (schedules.py:
# PipelineScheduleSingle and PipelineScheduleMulti); cleared, the next step infers again.
_INIT_FLAGS = (
    "_stage_forward_initialized",
    "_stage_backward_initialized",
    "_stages_forward_initialized",
    "_stages_backward_initialized",
)


class PipelineError(ModelError):
    """The model or the layout cannot be pipelined as asked; the message says what to change.
    A ModelError: every later task would fail the same way, so the run stops."""


# ---------------------------------------------------------------- the model's pieces


def check_pipelinable(config) -> None:
    """Refuse a configuration a stage cannot reproduce, as the pipeline's entry in
    jobgen.model.parallelism says (a family whose base model a stage does not reproduce, Mamba
    layers, the router's auxiliary loss):
    validate says the same of a local model."""
    from trainer.model.architecture import model_traits

    refusal = PIPELINED.model_refusal(model_traits(config))
    if refusal is not None:
        raise PipelineError(f"model.path: {refusal}")


class StageModule(nn.Module):
    """The stages one pipeline rank holds, under the full model's parameter names.

    Built from a causal LM (on meta, usually) whose pieces trainer.parallel.pipeline_parts finds:
    the input embedding (and GPT-2's positions) iff the rank holds stage 0, the decoder blocks of
    its stages keyed by global index (``model.layers.3``, ``transformer.h.3``), the final norm and
    the head iff it holds the last stage, and the (parameterless) rotary embedding.
    ``state_dict()``/``named_parameters()`` are those of the full model restricted to this rank,
    so checkpoints and the safetensors line up whatever the layout."""

    # Read by trainer.checkpoints.checkpointer.state_dict_options: the optimizer state keyed by parameter name.
    flat_optimizer_state = True

    def __init__(self, full: nn.Module, stage_ranges: Sequence[range], stage_indices: Sequence[int]):
        super().__init__()
        check_pipelinable(full.config)
        self.parts = ModelParts.of(full)
        parts = self.parts
        base = getattr(full, parts.base)
        blocks_of_model = getattr(base, parts.layers)
        self.config = full.config
        self.num_stages = len(stage_ranges)
        self.stage_ranges = [range(r.start, r.stop) for r in stage_ranges]
        self.stage_indices = list(stage_indices)
        if not self.stage_indices or any(not 0 <= s < self.num_stages for s in self.stage_indices):
            raise PipelineError(f"stage indices {self.stage_indices} outside 0..{self.num_stages - 1}")
        starts = [0, *(r.stop for r in self.stage_ranges)]
        if [r.start for r in self.stage_ranges] != starts[:-1] or starts[-1] != len(blocks_of_model):
            raise PipelineError(
                f"the stages' blocks {self.stage_ranges} do not cover the model's {len(blocks_of_model)} blocks in "
                "order (train.pipeline.layers_per_stage)"
            )
        blocks = sorted(i for s in self.stage_indices for i in self.stage_ranges[s])
        # The full model's names (model.layers.3, transformer.h.3, lm_head, embed_out), this rank's pieces only.
        mine = nn.Module()
        setattr(self, parts.base, mine)
        setattr(mine, parts.embed, getattr(base, parts.embed) if self.is_first else None)
        for extra in (parts.positions, parts.dropout):
            if extra:
                setattr(mine, extra, getattr(base, extra) if self.is_first else None)
        setattr(mine, parts.layers, nn.ModuleDict({str(i): blocks_of_model[i] for i in blocks}))
        setattr(mine, parts.norm, getattr(base, parts.norm) if self.is_last else None)
        if parts.rotary:
            setattr(mine, parts.rotary, getattr(base, parts.rotary))
        setattr(self, parts.head, getattr(full, parts.head) if self.is_last else None)
        # Tied input and output embeddings on two ranks: each holds a copy, whose gradients
        # trainer.parallel.pipeline_steps sums after every step (tied_pair).
        head_weight = getattr(full, parts.head).weight
        self.tied = head_weight is getattr(base, parts.embed).weight
        # The end-of-turn tokens samples stop at (trainer.evaluation.samples.stop_token_ids).
        self.generation_config = getattr(full, "generation_config", None)
        # What recomputes a buffer beside parameters (Gemma's embed_scale) after the sharded
        # load: the model's own initialisation (the full model is on meta: it holds no storage).
        self.initialise_weights = full._init_weights
        # Set by trainer.parallel.pipeline_steps: (layout, PipelineStep, mesh) for the trainer's steps.
        self.steps_state: tuple | None = None
        # A plain dict, not submodules: the views' own names must not enter state_dict().
        self._views: dict[int, StageView] = {}

    def check_replicable(self) -> None:
        """PipelineError when replicas cannot shard this rank's stages: a tied embedding whose
        first and last stage are both here is one parameter in two FSDP units."""
        if self.tied and self.is_first and self.is_last:
            raise PipelineError(
                "the model ties its input and output embeddings, and this layout puts the first and the last stage "
                "on one rank (train.pipeline.schedule's V placement, or a pipeline of one position) with replicas "
                "sharding them: use a 'loop' schedule over several positions (1f1b, interleaved-1f1b), or no replicas"
            )

    def weight_aliases(self) -> dict[str, str]:
        """A tied head on a rank without the embedding reads the embedding's tensor (the files
        hold it once)."""
        if not self.tied or self.is_first:
            return {}
        return {f"{self.parts.head}.weight": f"{self.parts.base}.{self.parts.embed}.weight"}

    @property
    def blocks(self) -> nn.ModuleDict:
        """This rank's decoder blocks, keyed by their index in the whole model."""
        return getattr(getattr(self, self.parts.base), self.parts.layers)

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (the input embedding)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (the norm, the output layer and the loss)."""
        return self.num_stages - 1 in self.stage_indices

    def stage_view(self, stage_index: int) -> nn.Module:
        """The module running stage ``stage_index`` alone, sharing this module's submodules
        (the same one on every call)."""
        if stage_index not in self.stage_indices:
            raise PipelineError(f"stage {stage_index} is not on this rank (it holds {self.stage_indices})")
        if stage_index not in self._views:
            self._views[stage_index] = StageView(self, self.parts, stage_index)
        return self._views[stage_index]

    def forward(self, *args, **kwargs):
        """Not used: the schedule runs each :meth:`stage_view`."""
        raise PipelineError("a StageModule runs through its stage views (stage_view), driven by a pipeline schedule")


# ---------------------------------------------------------------- building a rank's stages


def _wrap_data_parallel(module: StageModule, views: list[nn.Module], kind: str, mesh: DeviceMesh, device) -> None:
    """Each block, then each stage view, as a unit of ``kind`` over ``mesh`` (still on meta).
    reshard_after_forward=False: a schedule runs many micro-batches' forwards before their
    backwards, which would otherwise gather every block again for each (torchtitan's choice)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, object] = {"mesh": mesh}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if not STRATEGIES[kind].shards_parameters:  # whole copies: FSDP2's replicate
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for unit in [*module.blocks.values(), *views]:
            replicate(unit, **kwargs)
        return
    for unit in [*module.blocks.values(), *views]:
        fully_shard(unit, reshard_after_forward=False, **kwargs)


def build_stages(
    model_path: str,
    config,
    env: DistEnv,
    stage_ranges: Sequence[range],
    my_stage_indices: Sequence[int],
    dtype: torch.dtype,
    pp_group: dist.ProcessGroup | None,
    dp_mesh: DeviceMesh | None,
    data_parallel: str = "fsdp",
    *,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[StageModule, list[PipelineStage]]:
    """This rank's StageModule and one PipelineStage per stage it holds, filled from the
    safetensors at ``model_path``.

    ``config``: the transformers config (None: read from ``model_path``); ``stage_ranges``:
    every stage's blocks (jobgen.model.pipeline_split.stage_layers); ``my_stage_indices``: this
    rank's (stage_indices); ``dp_mesh``: the data-parallel (sub)mesh of this rank, wrapped
    with ``data_parallel`` ("fsdp", "hsdp" with a 2-D mesh, "ddp") when it has several ranks;
    ``prepare``: applied to the meta skeleton first (attention kernel, checkpointing).

    The skeleton is built on meta and only this rank's modules get storage; the weights come
    from one collective ``dcp.load`` where each rank asks for its own tensors (shards). Every
    rank of the world must call this together."""
    from torch.distributed.pipelining import PipelineStage
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model.architecture import CheckpointLayout
    from trainer.model.sharded_load import allocate_shards, model_directory, read_weights, recompute_buffers

    if data_parallel not in DATA_PARALLEL:
        raise PipelineError(f"train.parallelism = '{data_parallel}' with a pipeline: one of {', '.join(DATA_PARALLEL)}")
    config = config if config is not None else AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    check_pipelinable(config)  # before anything is built or any collective runs
    directory = model_directory(model_path)
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(config, dtype=dtype)
    full.config.use_cache = False  # stages never make a KV cache; keep the config honest
    if prepare is not None:
        full = prepare(full)
    # How the files' names map to the full model's (renamed heads, per-expert MoE tensors),
    # read before sharding: a StageModule is no transformers model, but keeps its names.
    layout = CheckpointLayout(full)
    module = StageModule(full, stage_ranges, my_stage_indices)
    del full  # the other ranks' modules, on meta: nothing to free but the references
    views = [module.stage_view(s) for s in module.stage_indices]
    if dp_mesh is not None and dp_mesh.size() > 1:
        module.check_replicable()
        _wrap_data_parallel(module, views, data_parallel, dp_mesh, env.device)
    allocate_shards(module, env.device)
    threads = max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    count = read_weights(module, directory, threads, layout, aliases=module.weight_aliases())
    recompute_buffers(module, env.device)
    log.info("pipeline stages %s: blocks %s, %d tensors read", module.stage_indices, list(module.blocks), count)
    stages = [
        PipelineStage(view, s, module.num_stages, env.device, group=pp_group)
        for view, s in zip(views, module.stage_indices)
    ]
    return module, stages


def checkpoint_options(module: StageModule) -> StateDictOptions:
    """Options for torch.distributed.checkpoint.state_dict's get/set_state_dict on a StageModule:
    the optimizer state *flattened* by parameter name. Unflattened, ``param_groups`` is a list
    naming each rank's own parameters under one key, which ranks of different stages would
    overwrite in each other's checkpoint. (LoRA, frozen parameters: as trainer.checkpoints.checkpointer.)"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in module.parameters())
    return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=not frozen)


# ---------------------------------------------------------------- running a step


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable):
    """torch's schedule ``name`` (jobgen's name, jobgen.model.pipeline_split.SCHEDULES) over this
    rank's ``stages``. ``scale_grads=False`` always: ``loss_fn`` returns each micro-batch's
    token-summed loss already scaled to the whole batch (see the module docstring)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    if not stages:
        raise PipelineError("a pipeline schedule needs at least one stage on this rank")
    problem = schedule_problem(name, stages[0].group_size, stages[0].num_stages, n_microbatches)
    if problem:
        raise PipelineError(problem)
    cls = get_schedule_class(SCHEDULES[name].torch_name)
    kwargs = {"n_microbatches": n_microbatches, "loss_fn": loss_fn, "scale_grads": False}
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise PipelineError(
                f"train.pipeline.schedule = '{name}' runs one stage per rank, this one has {len(stages)}"
            )
        return cls(stages[0], **kwargs)
    return cls(stages, **kwargs)


def forget_shapes(schedule) -> None:
    """Make ``schedule`` infer its stages' activation shapes again at its next step (one extra
    forward and backward of micro-batch 0). Every rank of the pipeline must do it together."""
    found = [flag for flag in _INIT_FLAGS if hasattr(schedule, flag)]
    if not found:  # another torch: failing here beats a hang on mis-sized receive buffers
        raise RuntimeError(f"{type(schedule).__name__} has none of {_INIT_FLAGS}; torch changed its schedules")
    for flag in found:
        setattr(schedule, flag, False)


class PipelineStep:
    """One optimizer step's forward and backward on this rank's stages.

    ``step = PipelineStep("1f1b", stages, n_microbatches)`` then, every optimizer step,
    ``step(input_ids, position_ids, labels, scale)`` with one data-parallel replica's whole
    batch ([rows, seq] each, the same on every pipeline rank of the replica; rows a multiple
    of the micro-batches, split along rows). Gradients accumulate into the parameters' ``.grad``
    (under FSDP: reduced over the data-parallel mesh); zero them after the optimizer step.

    ``sync_group``: the ranks that must agree on re-inferring shapes when a batch's shape
    changes (default: the world; with data parallelism the FSDP collectives of the shape
    inference span replicas)."""

    def __init__(self, schedule: str, stages: list[PipelineStage], n_microbatches: int, *, sync_group=None) -> None:
        self.n_microbatches = n_microbatches
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.sync_group = sync_group
        self._scale = 1.0
        self._sums: list[torch.Tensor] = []
        self._shape: tuple | None = None
        self.schedule = build_schedule(schedule, stages, n_microbatches, self._loss)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed, _count = token_loss_sum(logits, labels)
        # Noted for the step's report; shape inference calls this once more before the
        # real micro-batches, so only the last n_microbatches entries count.
        self._sums.append(summed.detach())
        return summed * self._scale

    def _agree_on_shapes(self, shape: tuple) -> None:
        """Re-infer shapes on every rank when any rank's batch shape changed (one all-reduce of
        a host tensor: gloo, also under the trainer's "cpu:gloo,cuda:nccl" backend)."""
        changed = torch.tensor([int(shape != self._shape)], dtype=torch.int64)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.sync_group)
        if int(changed) and self._shape is not None:
            forget_shapes(self.schedule)
        self._shape = shape

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor,
        scale: float,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of the batch; returns this rank's summed next-token loss
        (unscaled, float64): the sum over the last stage's micro-batches, 0 on other ranks.
        ``scale``: data-parallel size / target tokens of the global batch (all replicas).
        ``position_ids`` None: 0..seq-1 on every row; ``attention_mask``: unpacked rows."""
        rows, seq = input_ids.shape
        if rows % self.n_microbatches:
            # Unequal micro-batches would not fit the receive buffers sized for micro-batch 0.
            raise PipelineError(
                f"a batch of {rows} rows does not split into {self.n_microbatches} equal micro-batches "
                "(train.pipeline.microbatches must divide the rows of a replica's batch)"
            )
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).repeat(rows, 1)
        kwargs = {"position_ids": position_ids}  # split along rows and passed to every stage
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        self._agree_on_shapes((rows, seq, attention_mask is not None))
        self._scale = float(scale)
        self._sums = []
        args = (input_ids,) if self.has_first else ()
        target = labels if self.has_last else None
        self.schedule.step(*args, target=target, losses=[], return_outputs=False, **kwargs)
        if not self.has_last:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(self._sums[-self.n_microbatches :]).double().sum().cpu()


# ---------------------------------------------------------------- gradient norm


def grad_norm_and_clip(
    stage_module: StageModule, max_norm: float, pp_group: dist.ProcessGroup | None, skip: nn.Parameter | None = None
) -> float:
    """The gradient norm of the whole model, then clipped to ``max_norm`` (inf: no clipping).
    Each rank holds only its stages' gradients (under FSDP, its shards of them): the local
    norm is the full norm over the data-parallel mesh, and the squares are summed over the
    pipeline group. ``skip``: a parameter another rank holds a copy of (a tied output layer),
    left out of the norm and clipped all the same."""
    from torch.distributed.tensor import DTensor

    params = [p for p in stage_module.parameters() if p.grad is not None]
    counted = [p for p in params if p is not skip]
    if counted:
        local = torch.nn.utils.get_total_norm([p.grad for p in counted], norm_type=2.0)
        if isinstance(local, DTensor):
            local = local.full_tensor()
    else:
        local = torch.zeros(())
    squared = local.detach().double().pow(2)
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
    total = squared.sqrt().float()
    if params and not math.isinf(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
