"""The [train.pipeline] table of run.toml: how ``train.parallelism = "pipeline"`` splits the
model, and the checks that need the world size (the loader runs them for every world a task
may get, the trainer again for the world torchrun formed). The rules themselves (schedules,
splits) are jobgen/model/pipeline_split.py's."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from jobgen.model.pipeline_split import MICROBATCHES_KEY, SCHEDULE_KEY, SCHEDULES, schedule_problem
from jobgen.spec.fields import SpecModel

SIZE_KEY = "train.pipeline.size"

ScheduleName = Literal[
    "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev"
]
assert set(ScheduleName.__args__) == set(SCHEDULES), "one spec name per schedule in jobgen.model.pipeline_split"


class PipelineSpec(SpecModel):
    """Pipeline parallelism: consecutive decoder blocks on consecutive ranks, activations passed
    between them by torch.distributed.pipelining's schedules."""

    size: int | None = Field(
        None,
        ge=1,
        description=(
            "Ranks one pipeline spans (default: the whole world, one pipeline). With fewer, the world holds "
            "world / size pipelines that train as data-parallel replicas (data_parallel). Ranks r*P .. r*P+P-1 "
            "(P = world / size) hold stage group r, so on nodes with P processes each node is one pipeline "
            "position and only activations cross the network between nodes."
        ),
    )
    stages: int | None = Field(
        None,
        ge=1,
        description=(
            "Pipeline stages (default: one per pipeline rank, two per rank for the schedules that run several: "
            "interleaved-1f1b, looped-bfs, interleaved-zero-bubble, zbv-zero-bubble, dualpipev). Each stage holds "
            "a contiguous run of decoder blocks; the first also holds the embedding, the last the norm, the "
            "output layer and the loss."
        ),
    )
    schedule: ScheduleName = Field(
        "1f1b",
        description=(
            "torch.distributed.pipelining's schedule: 'gpipe' (all forwards then all backwards: activations of "
            "every micro-batch in flight), '1f1b' (at most one micro-batch per stage in flight), "
            "'interleaved-1f1b' and 'looped-bfs' (several stages per rank, a smaller bubble), "
            "'interleaved-zero-bubble', 'zbv-zero-bubble' and 'dualpipev' (input and weight gradients split to "
            "fill the bubble)."
        ),
    )
    microbatches: int | None = Field(
        None,
        ge=1,
        description=(
            "Pieces each micro-batch (train.micro_batch_size rows of one replica) is split into for the "
            "schedule (default: micro_batch_size, one row each). Must divide micro_batch_size; '1f1b', "
            "'zbv-zero-bubble' and 'dualpipev' need at least as many as stages. The loss is normalised over "
            "the whole batch's target tokens, so the split does not change the result."
        ),
    )
    layers_per_stage: list[Annotated[int, Field(ge=1, le=100_000)]] | None = Field(
        None,
        min_length=1,
        description=(
            "Decoder blocks of each stage, e.g. [10, 12, 10], each at least 1, summing to the model's blocks (validate "
            "checks a local model's) (default: balanced by parameter count, the embedding counting towards the first "
            "stage and the output layer towards the last)."
        ),
    )
    data_parallel: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description=(
            "How the pipelines (world / size of them) combine: 'fsdp' shards each stage's parameters, "
            "gradients and optimizer state over its replicas (FSDP2); 'ddp' keeps a whole copy of the stage on "
            "each (FSDP2's replicate). Unused with one pipeline."
        ),
    )

    def pipeline_size(self, world_size: int) -> int:
        """Ranks one pipeline spans in a world of ``world_size``."""
        return self.size or world_size

    def stage_count(self, world_size: int) -> int:
        """Stages in a world of ``world_size``: train.pipeline.stages, or one (or two, for the
        schedules that place several) per pipeline rank."""
        if self.stages is not None:
            return self.stages
        per_rank = SCHEDULES[self.schedule].stages_per_rank
        size = self.pipeline_size(world_size)
        return size * (per_rank if per_rank is not None else 2)

    def microbatch_count(self, micro_batch_size: int) -> int:
        return self.microbatches or micro_batch_size

    def world_problem(self, world_size: int, micro_batch_size: int) -> tuple[str, str] | None:
        """(key, why) when this pipeline cannot run in a world of ``world_size`` ranks; None when it can."""
        size = self.pipeline_size(world_size)
        if size > world_size or world_size % size:
            return SIZE_KEY, f"{SIZE_KEY} = {size} must divide the world size {world_size}"
        micro = self.microbatch_count(micro_batch_size)
        if micro_batch_size % micro:
            return MICROBATCHES_KEY, (
                f"{MICROBATCHES_KEY} = {micro} must divide train.micro_batch_size = {micro_batch_size} "
                "(each micro-batch is split into equal pieces)"
            )
        problem = schedule_problem(self.schedule, size, self.stage_count(world_size), micro)
        if problem:  # the message names every key involved
            return SCHEDULE_KEY, problem
        if self.layers_per_stage is not None and len(self.layers_per_stage) != self.stage_count(world_size):
            return "train.pipeline.layers_per_stage", (
                f"train.pipeline.layers_per_stage has {len(self.layers_per_stage)} entries for "
                f"{self.stage_count(world_size)} stages: give one block count per stage"
            )
        return None
