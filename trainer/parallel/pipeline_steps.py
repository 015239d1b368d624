"""``train.parallelism = "pipeline"`` in the trainer: where this rank sits in the pipeline, the
model it builds (its stages, trainer.parallel.pipeline.build_stages) and how it runs a step
(:class:`PipelineSteps`, the pipeline's entry in trainer/parallel/strategies.py's table).

Layout. The world is a ``(pp, dp)`` mesh: ``pp = train.pipeline.size`` (default the world)
pipeline positions, ``dp = world / pp`` replicas. Rank ``r`` is pipeline position
``r // dp`` and replica ``r % dp``: with ``dp`` processes per node, each node is one pipeline
position, the replicas' FSDP collectives stay on the node and only activations cross the
network between nodes. The data sampler shards rows over the ``dp`` replicas; every rank of
one pipeline reads the same rows (the first stage feeds them in, the last scores them).

A step. The step's ``grad_accum`` micro-batches (``train.micro_batch_size`` rows each) run
through one ``schedule.step``, each split into ``train.pipeline.microbatches`` pieces; the loss is
token-summed and scaled by replicas / global target tokens (trainer.parallel.pipeline.PipelineStep),
so the result equals the unpipelined run's. Stop, save and switch decisions are taken at the
step boundary by the loop, never inside a schedule.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from jobgen.model.pipeline_split import NodeMemory, stage_capacities, stage_indices, stage_layers, stage_positions
from jobgen.spec.global_batch import grad_accum_for
from jobgen.spec.tables.model import ModelSpec
from jobgen.spec.tables.train import TrainSpec
from trainer.data.batches import model_inputs_on, to_device
from trainer.data.packing import IGNORE_INDEX, token_loss_sum
from trainer.distributed import DistEnv
from trainer.model.prep import attention_implementation, compile_decoder_blocks, compiles_blocks, param_dtype, prepare
from trainer.parallel.pipeline import PipelineError, PipelineStep, StageModule, build_stages, grad_norm_and_clip
from trainer.parallel.pipeline_forward import StagesForward
from trainer.parallel.step_parts import StepParts
from trainer.parallel.step_runner import autocast_for

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


log = logging.getLogger("trainer.parallel.pipeline")

MESH_DIMS = ("pp", "dp")


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's place: pipeline position and replica, and the sizes of both."""

    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int

    @classmethod
    def of(cls, train: TrainSpec, env: DistEnv) -> PipelineLayout:
        assert train.pipeline is not None
        problem = train.pipeline.world_problem(env.world_size, train.micro_batch_size)
        if problem:  # the loader checked the spec's worlds; a resume may have formed another
            raise PipelineError(f"this task's world of {env.world_size}: {problem[1]}")
        mesh = train.mesh(env.world_size, env.local_world_size)
        pp_rank, dp_rank = mesh.position(env.rank)
        return cls(pp_size=mesh.pp, dp_size=mesh.dp, pp_rank=pp_rank, dp_rank=dp_rank)


@functools.cache
def _mesh(device_type: str, pp: int, dp: int) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    # Row-major: rank r at (r // dp, r % dp), as PipelineLayout numbers them.
    return init_device_mesh(device_type, (pp, dp), mesh_dim_names=MESH_DIMS)


def _embed_and_head_weights(config) -> tuple[float, float]:
    """The embedding and the output layer (plus the final norm) in units of one decoder block's
    parameters: what the first and last stage hold besides their blocks."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    # GPT-2 names its MLP's width n_inner (None: 4 x hidden); a mixture's block is weighed as dense.
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    block = attention + 3 * hidden * inter + 2 * hidden
    table = config.vocab_size * hidden
    return table / block, (table + hidden) / block


def _stage_ranges(
    config, train: TrainSpec, env: DistEnv, stages: int, nodes: NodeMemory | None
) -> tuple[list[range], list[float] | None]:
    """Each stage's blocks, as ``jobgen plan`` splits them (jobgen.plan.pipeline.layout_of): by
    parameters, or by the nodes' device memory too (job.device_memory); and those capacities."""
    assert train.pipeline is not None
    embed, head = _embed_and_head_weights(config)
    capacities = None
    if nodes is not None and train.pipeline.layers_per_stage is None:
        mesh = train.mesh(env.world_size, env.local_world_size)
        capacities = stage_capacities(mesh, train.pipeline.schedule, stages, nodes)
    ranges = stage_layers(
        config.num_hidden_layers,
        stages,
        layers_per_stage=train.pipeline.layers_per_stage,
        embed_weight=embed,
        head_weight=head,
        capacities=capacities,
    )
    return ranges, capacities


def build_pipeline_model(
    spec: ModelSpec, train: TrainSpec, env: DistEnv, packing: bool, nodes: NodeMemory | None = None
) -> StageModule:
    """This rank's stages, built on meta and filled from the safetensors (each rank reads only
    its blocks), wrapped over the replicas; ``module.steps_state`` holds what a step needs.
    ``nodes``: each node's device memory (job.device_memory), which the stages' blocks follow
    as ``jobgen plan`` splits them."""
    from transformers import AutoConfig

    assert train.pipeline is not None
    layout = PipelineLayout.of(train, env)
    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=False)  # no code from the model directory
    stages = train.pipeline.stage_count(env.world_size)
    ranges, capacities = _stage_ranges(config, train, env, stages, nodes)
    mine = stage_indices(train.pipeline.schedule, layout.pp_rank, layout.pp_size, stages)
    mesh = _mesh(env.device.type, layout.pp_size, layout.dp_size)
    attention = attention_implementation(spec, env.device, packing)
    compile_blocks = compiles_blocks(train, env.device)

    def ready(model: torch.nn.Module) -> torch.nn.Module:
        model = prepare(model, spec, attention)
        return compile_decoder_blocks(model) if compile_blocks else model

    module, pipeline_stages = build_stages(
        spec.path,
        config,
        env,
        ranges,
        mine,
        param_dtype(spec, env.device),
        mesh.get_group("pp"),
        mesh["dp"],
        train.pipeline.data_parallel,
        prepare=ready,
    )
    if env.is_main:
        split = ", ".join(f"{r.start}-{r.stop - 1}" for r in ranges)
        log.info(
            "pipeline: %d stage(s) over %d rank(s) x %d replica(s), schedule %s, blocks per stage %s%s",
            stages,
            layout.pp_size,
            layout.dp_size,
            train.pipeline.schedule,
            split,
            f" (job.device_memory: stages' memory {[round(c, 2) for c in capacities]})" if capacities else "",
        )
    # All grad_accum micro-batches of a step go through one schedule step: FSDP2 under torch's
    # schedules (2.13) does not accumulate gradients over several (measured: the norm of a
    # 2-micro-batch step came out 0.54 of DDP's), and more pieces shrink the bubble.
    micro = train.pipeline.microbatch_count(train.micro_batch_size) * grad_accum_for(train, env.world_size)
    module.steps_state = (layout, PipelineStep(train.pipeline.schedule, pipeline_stages, micro), mesh)
    return module


def data_shard(train: TrainSpec, env: DistEnv) -> tuple[int, int]:
    """(rank, size) of the data sampler: the replica, not the rank."""
    layout = PipelineLayout.of(train, env)
    return layout.dp_rank, layout.dp_size


def join_micro_batches(micro_batches: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The step's micro-batches as one batch for one schedule step, right-padded to the
    longest: input_ids with the pad token, labels ignored, attention_mask 0, position_ids
    counting from 0 (a padding segment of its own, as trainer.data.packing.collate pads)."""
    longest = max(int(b["input_ids"].shape[1]) for b in micro_batches)
    fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    joined: dict[str, torch.Tensor] = {}
    for key in ("input_ids", "labels", "attention_mask", "position_ids"):
        if key not in micro_batches[0]:
            continue
        parts = []
        for batch in micro_batches:
            tensor = batch[key]
            rows, missing = tensor.shape[0], longest - tensor.shape[1]
            if missing:
                tail = (
                    torch.arange(missing, dtype=tensor.dtype).repeat(rows, 1)
                    if key == "position_ids"
                    else torch.full((rows, missing), fills[key], dtype=tensor.dtype)
                )
                tensor = torch.cat([tensor, tail], dim=1)
            parts.append(tensor)
        joined[key] = torch.cat(parts)
    return joined


class PipelineSteps:
    """A step of the pipeline: each micro-batch through the schedule, then the gradient norm
    over the whole model (the squares summed over the pipeline positions)."""

    def __init__(self, parts: StepParts):
        module = parts.model
        assert isinstance(module, StageModule) and module.steps_state is not None, "built by build_pipeline_model"
        self.module = module
        self.device = parts.env.device
        self.pad_token_id = parts.pad_token_id
        self.layout, self.step, mesh = module.steps_state
        self.pp_group = mesh.get_group("pp")
        layout, train = self.layout, parts.train
        assert train.pipeline is not None
        self.tied = tied_pair(module, train.pipeline.schedule, layout)
        # Evaluation and samples: forward only, stage after stage (trainer.parallel.pipeline_forward).
        self.forward = StagesForward(
            module, train.pipeline.schedule, layout.pp_size, layout.pp_rank, layout.dp_size, layout.dp_rank
        )

    @property
    def scores_eval(self) -> bool:
        return self.module.is_last

    @property
    def greedy_token(self) -> Callable[[torch.Tensor], int]:
        return self.forward.greedy_token

    def eval_loss_sum(self, inputs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
        """An evaluation batch through every stage; the summed loss on the last stage, 0 elsewhere."""
        input_ids = inputs["input_ids"]
        positions = inputs.get("position_ids")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).repeat(input_ids.shape[0], 1)
        logits = self.forward(input_ids, positions, inputs.get("attention_mask"))
        if logits is None:
            return torch.zeros((), dtype=torch.float64, device=input_ids.device)
        summed, _count = token_loss_sum(logits.float(), to_device(labels, self.device))
        return summed

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], scale: float) -> torch.Tensor:
        batch = join_micro_batches(micro_batches, self.pad_token_id)
        inputs = model_inputs_on(batch, self.device)
        with autocast_for(self.device):
            loss_sum = self.step(
                inputs["input_ids"],
                inputs.get("position_ids"),
                to_device(batch["labels"], self.device),
                scale,
                attention_mask=inputs.get("attention_mask"),
            )
        if self.tied is not None:
            self.tied.sum_gradients()
        return loss_sum

    def step_report(self) -> dict[str, float]:
        return {}

    def clip(self, max_norm: float) -> float:
        counted_twice = self.tied.second_copy if self.tied is not None else None
        return grad_norm_and_clip(self.module, max_norm, self.pp_group, skip=counted_twice)


class TiedCopies:
    """A tied embedding and output layer on the ranks of the first and the last stage: one
    copy each, the same at the start (both read the embedding's tensor) and kept the same by
    summing their gradients every step, so both optimizers take the same step on them. The
    gradient norm counts the weight once (the last stage's copy is skipped)."""

    def __init__(self, weight: torch.nn.Parameter, group, is_last: bool):
        self.weight, self.group = weight, group
        self.second_copy = weight if is_last else None

    def sum_gradients(self) -> None:
        import torch.distributed as dist

        grad = self.weight.grad
        if grad is None:  # a stage that got no gradient still takes part (zeros)
            grad = self.weight.grad = torch.zeros_like(self.weight)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=self.group)


def tied_pair(module: StageModule, schedule: str, layout: PipelineLayout) -> TiedCopies | None:
    """For a tied model whose first and last stages are on two ranks: this rank's copy and the
    group of the two ranks (one per replica; every rank creates every group, as
    torch.distributed.new_group asks). None when untied, or both stages are on one rank (one
    parameter, used twice)."""
    import torch.distributed as dist

    if not module.tied:
        return None
    positions = stage_positions(schedule, layout.pp_size, module.num_stages)
    first, last = positions[0], positions[-1]
    if first == last:
        return None
    mine = None
    for replica in range(layout.dp_size):
        group = dist.new_group([first * layout.dp_size + replica, last * layout.dp_size + replica])
        if replica == layout.dp_rank:
            mine = group
    if not (module.is_first or module.is_last):
        return None
    parts = module.parts
    holder = getattr(getattr(module, parts.base), parts.embed) if module.is_first else getattr(module, parts.head)
    return TiedCopies(holder.weight, mine, module.is_last)
