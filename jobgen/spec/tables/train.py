"""The [train] table of run.toml: the optimisation loop, its batch and its parallelism.
Apart from jobgen/spec/tables/run.py, which holds the whole run, for its size: every key here is the
reference (jobgen schema)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator, model_validator

from jobgen.base.durations import format_human
from jobgen.model.mesh import Mesh, context_parallel_problem, mesh_of
from jobgen.model.parallelism import (
    CPU_OFFLOAD,
    IN_BACKWARD,
    LOSS_CHUNKS,
    PER_PARAMETER_CLIP,
    STRATEGIES,
    Parallelism,
    ParallelismName,
)
from jobgen.spec.fields import Duration, SpecModel
from jobgen.spec.tables.pipeline import PipelineSpec

# The largest train.seed: the trainer seeds each rank's generator with seed * 1000 + rank
# (trainer.loop), which torch.manual_seed takes below 2**64 (above: "Overflow when unpacking
# long long" on every rank), and 2**53 - 1 is the largest integer every JSON reader of
# spec.json and metrics.json keeps exact. numpy is seeded from a hash of it (trainer.data.sampler).
MAX_SEED = 2**53 - 1
# The batch script looks at the heartbeats every few seconds: a shorter hang timeout would
# mistake a slow step for a hang.
MIN_HANG_TIMEOUT = 10
# A collective that may wait a month is no timeout; torch's timedelta overflows near 2.7 million years.
MAX_COLLECTIVE_TIMEOUT = 30 * 86400


class TrainSpec(SpecModel):
    """The optimisation loop."""

    parallelism: ParallelismName = Field(
        "ddp",
        description=(
            "'ddp': DistributedDataParallel, a whole replica per rank. 'fsdp': FSDP2 (fully_shard), parameters, "
            "gradients and optimizer state sharded over every rank; on several nodes each block's parameters are "
            "all-gathered across the network twice a step. 'hsdp': FSDP2 on a 2-D mesh, sharded within a node "
            "(train.shard_size ranks) and replicated across nodes, so the all-gathers stay on the node's links and "
            "only gradients cross the network, once a step; each node holds a whole copy of the model's state. "
            "'pipeline': decoder blocks split into stages over ranks ([train.pipeline]), only activations cross "
            "between them: for nodes joined by Ethernet, where FSDP's all-gathers are slow."
        ),
    )
    pipeline: PipelineSpec | None = Field(
        None,
        description="[train.pipeline]: the stages and schedule of parallelism = 'pipeline' (defaults when absent).",
    )
    context_parallel: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Ranks each sequence is split across (context parallelism), for a max_length whose activations "
            "outgrow one device: the N consecutive ranks of a group read the same rows and each keeps 1/N of every "
            "row's tokens through the whole model (cut into 2N chunks, head and tail, so causal work is even); "
            "attention gathers the keys and values of the whole row from the group and keeps packed documents "
            "apart. Activations per rank drop by about N; the world must be a multiple of N, and the data-parallel "
            "replicas are world / N. Works on CPU (gloo) and GPUs, with 'ddp', 'fsdp' and 'hsdp'; not with "
            "'pipeline', [eval] or loss_chunk_tokens; target_logits_only is not applied under it."
        ),
    )
    expert_parallel: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Ranks each mixture-of-experts layer's routed experts are split over (expert parallelism): the N "
            "consecutive ranks of a group hold E / N experts each, and every token is sent to the rank of each "
            "expert its router chose and back (all-to-all); the ranks holding the same experts (world / N) shard "
            "them with FSDP. Every rank still reads its own rows. Checkpoints hold every expert whole, so a run "
            "resumes with another N. With parallelism = 'fsdp' only; N must divide the world size and the experts "
            "per layer."
        ),
    )
    shard_size: int | None = Field(
        None,
        ge=1,
        description=(
            "With parallelism = 'hsdp': ranks one copy of the model is sharded over (default: the processes per "
            "node). Must divide the world size; the copies (world size / shard_size) all-reduce their gradients."
        ),
    )
    cpu_offload: bool = Field(
        False,
        description=(
            "With parallelism = 'fsdp' or 'hsdp' on a GPU site: keep the parameter, gradient and optimizer-state "
            "shards in pinned host memory and step the optimizer on the CPU (FSDP2's CPUOffloadPolicy); each block "
            "is copied to the GPU for its forward and backward. The GPU then holds little more than one block and "
            "the activations, the host holds the states (jobgen plan says how much per node) and steps are slower. "
            "Refused on a site without GPUs, where everything is in host memory already."
        ),
    )
    micro_batch_size: int = Field(4, ge=1, description="Sequences per process per micro-step.")
    grad_accum: int = Field(
        1,
        ge=1,
        description=(
            "Micro-steps per optimizer step; the global batch is micro_batch_size x grad_accum x world size. "
            "Derived for each task instead when global_batch_size is set."
        ),
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description=(
            "Sequences per optimizer step over all ranks. When set, grad_accum is derived for each task from the "
            "world size it runs on (global_batch_size / (micro_batch_size x world size), which must divide), so a "
            "run keeps its batch when it resumes on other nodes or on fewer (job.min_nodes). Unset, a resume whose "
            "global batch differs from the checkpoint's is refused unless allow_batch_change = true."
        ),
    )
    allow_batch_change: bool = Field(
        False,
        description=(
            "Resume a checkpoint with a global batch other than the one it was trained with (a new world size "
            "with the same grad_accum). The learning rate schedule goes on by steps, not by samples."
        ),
    )
    lr: float = Field(2e-5, gt=0, description="Peak learning rate.")
    optimizer: Literal["adamw", "adafactor"] = Field(
        "adamw",
        description=(
            "'adamw' (betas 0.9, 0.95): two float32 moments per parameter (8 bytes per parameter). "
            "'adafactor' (torch.optim.Adafactor): the low-memory optimizer, no first moment (no momentum) and a "
            "factored second moment (a row and a column vector per matrix), so its state is a small fraction of "
            "the parameters' size."
        ),
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps before the cosine decay.")
    grad_clip: float = Field(1.0, ge=0, description="Max gradient norm (see grad_clip_mode); 0 disables clipping.")
    grad_clip_mode: Literal["global", "per_parameter"] = Field(
        "global",
        description=(
            "'global': scale all gradients together so that their joint norm is at most grad_clip. "
            "'per_parameter': clip each parameter's gradient norm to grad_clip on its own (the only clipping "
            "possible with optimizer_in_backward, where no step ever holds all gradients at once)."
        ),
    )
    optimizer_in_backward: bool = Field(
        False,
        description=(
            "Step the optimizer for each parameter as soon as its gradient is ready during backward, and free "
            "that gradient at once: the gradients of the whole model are never held together. One optimizer "
            "per parameter; checkpoints resume exactly. Needs grad_accum = 1 and either grad_clip = 0 or "
            "grad_clip_mode = 'per_parameter'; with parallelism = 'ddp' only one process (job.nodes = 1, "
            "job.procs_per_node = 1), as DDP's gradient hooks run before its all-reduce. Works with 'fsdp', "
            "whose hooks run on the reduce-scattered gradient shard. The logged grad_norm is the norm before "
            "clipping, summed in the hooks."
        ),
    )
    loss_chunk_tokens: int = Field(
        0,
        ge=0,
        le=1_048_576,
        description=(
            "Compute the loss through the output layer this many tokens at a time, recomputing each chunk's "
            "logits in backward, so the float32 logits of the whole sequence (tokens x vocabulary) never exist; "
            "e.g. 1024. Same loss and gradients as the full computation up to rounding. 0 computes the logits "
            "(of the target positions, with target_logits_only) at once. "
            "Needs an output layer that is a plain linear layer whose output the model returns as is "
            "(Llama, Qwen, Mistral...); the trainer refuses other architectures at start."
        ),
    )
    target_logits_only: bool = Field(
        True,
        description=(
            "Send only the positions that have a target through the output layer: in SFT the prompt tokens "
            "carry no loss, and the output layer (tokens x hidden x vocabulary) is the largest matrix product "
            "of a small model. The loss and gradients are those of the full computation up to rounding. "
            "Models whose output layer is not a plain linear layer, or that post-process their logits, get "
            "the full computation (a log line says so); false always computes every position's logits."
        ),
    )
    compile: bool | None = Field(
        None,
        description=(
            "torch.compile each decoder block (fusing its norms, rotary embeddings, activations and residual "
            "adds; the output layer and the loss stay eager). Default: on for GPUs, off on CPU. The first steps "
            "of every job pay the compilation."
        ),
    )
    max_steps: int = Field(1000, ge=1, description="Optimizer steps in the whole run (across array tasks).")
    save_every_steps: int = Field(500, ge=0, description="Checkpoint every N steps; 0 disables step-based saves.")
    save_every: Duration = Field("30m", description="Also checkpoint after this much wall time since the last save.")
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept on disk (oldest deleted first).")
    async_save: bool = Field(False, description="Save in the background; training blocks only for the staging copy.")
    snapshot_every_steps: int = Field(
        0,
        ge=0,
        description=(
            "Where the task relaunches the trainer (job.in_job_restarts > 0): every N steps each rank copies its "
            "shard of the training state (model, optimizer, RNG, data position) to host memory and writes it in "
            "the background to a file on its node's tmpfs (site paths.snapshot_dir) and to a copy on the next "
            "node; the two newest are kept. A relaunch inside the same task resumes from the newest snapshot of "
            "which every rank's file is held on some node (a rank moved to a spare gets the copy) when it is "
            "newer than the newest checkpoint on disk, so a crash redoes at most N steps (2N when a rank dies "
            "while the newest is being written or mirrored) instead of every step since the last save. Snapshots "
            "never leave the task (the batch script deletes them as it ends); disk checkpoints stay the durable "
            "record. Costs four copies of each rank's state in its node's and the next node's host memory at "
            "rest, more while one is written. 0 (the default): none."
        ),
    )
    seed: int = Field(
        1234,
        ge=0,
        le=MAX_SEED,
        description=(
            f"Seed for data order, initialisation and dropout, from 0 to {MAX_SEED} (2^53 - 1: the trainer seeds "
            "each rank's generator with seed x 1000 + rank, which torch takes below 2^64, and every JSON reader "
            "keeps such a number exact)."
        ),
    )
    log_every_steps: int = Field(10, ge=1, description="Append a metrics line every N steps.")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description=(
            "Experiment trackers that get every logged step, from rank 0: 'tensorboard' (event files in "
            "<run>/tensorboard/) and/or 'wandb' (one W&B run for the whole jobgen run, resumed by every array "
            "task; offline under <run>/wandb/ when the node cannot reach W&B). A tracker that fails never stops "
            "training. Needs the [track] extra."
        ),
    )
    wandb_project: str = Field(
        "jobgen", min_length=1, description="W&B project for report_to = ['wandb']; the run is named after job.name."
    )
    collective_timeout: Duration = Field(
        "10m",
        description=(
            "Timeout of every collective; a rank that hangs longer ends the job. From 1s to "
            f"{format_human(MAX_COLLECTIVE_TIMEOUT)} (torch keeps it as a timedelta)."
        ),
    )
    hang_timeout: Duration | None = Field(
        None,
        description=(
            "Where the task relaunches the trainer (job.in_job_restarts > 0): when no rank has taken a step "
            "(or an evaluation batch) for this long, the batch script takes every rank's stacks with py-spy "
            "(<run>/hangs/), kills the launch and relaunches it, so a hang costs this timeout and a restart "
            "instead of the rest of the time limit. Checkpoint saves and the time before the first step do not "
            "count. A hang at the same step as the previous launch's stops the run. At least 10s and shorter "
            "than train.collective_timeout (a collective that times out first is a crash); default: half of it."
        ),
    )
    max_host_memory_percent: float = Field(
        95.0, gt=0, le=100, description="Save and exit when host memory use exceeds this percentage."
    )
    min_gpu_free_memory_mib: int = Field(
        0, ge=0, description="Save and exit when free GPU memory drops below this (MiB); 0 disables."
    )
    host_allocator: Literal["auto", "lean", "glibc"] = Field(
        "auto",
        description=(
            "How each process's host memory is allocated. 'lean': tensors of 256 KiB or more get their own "
            "mappings, returned to the system when freed: the lowest and flattest resident set, but every new "
            "large tensor costs page faults (about 20 % slower steps when training on CPU). 'glibc': glibc's own "
            "allocator, which keeps freed memory in its heaps for reuse: fastest, with a larger resident set. "
            "'auto': lean on GPU sites and for CPU runs whose predicted peak (jobgen plan) exceeds half of the "
            "host memory one process may use, glibc otherwise. MALLOC_MMAP_THRESHOLD_ in the environment wins."
        ),
    )

    @field_validator("collective_timeout")
    @classmethod
    def _timeout_in_range(cls, seconds: int) -> int:
        if not 1 <= seconds <= MAX_COLLECTIVE_TIMEOUT:
            raise ValueError(
                f"{format_human(seconds)} is outside 1s to {format_human(MAX_COLLECTIVE_TIMEOUT)}: a collective "
                "timeout of 0 fails the rendezvous itself, and one over a month never ends a hung job"
            )
        return seconds

    @model_validator(mode="after")
    def _hang_timeout_in_range(self) -> TrainSpec:
        if self.hang_timeout is not None and not MIN_HANG_TIMEOUT <= self.hang_timeout < self.collective_timeout:
            raise ValueError(
                f"train.hang_timeout = {format_human(self.hang_timeout)}: it must be at least "
                f"{format_human(MIN_HANG_TIMEOUT)} (the batch script looks every few seconds) and shorter than "
                f"train.collective_timeout ({format_human(self.collective_timeout)}), which would otherwise end "
                "a hung collective first, as a crash"
            )
        return self

    @property
    def effective_hang_timeout(self) -> int:
        """train.hang_timeout, or half of the collective timeout (at least MIN_HANG_TIMEOUT)."""
        if self.hang_timeout is not None:
            return self.hang_timeout
        return max(MIN_HANG_TIMEOUT, self.collective_timeout // 2)

    @property
    def strategy(self) -> Parallelism:
        """train.parallelism's entry (jobgen.model.parallelism): what it shards and refuses."""
        return STRATEGIES[self.parallelism]

    def turned_on(self) -> frozenset[str]:
        """The settings of this table that a parallelism may refuse, of those that are on."""
        settings = {
            CPU_OFFLOAD: self.cpu_offload,
            IN_BACKWARD: self.optimizer_in_backward,
            LOSS_CHUNKS: self.loss_chunk_tokens > 0,
            PER_PARAMETER_CLIP: self.grad_clip > 0 and self.grad_clip_mode == "per_parameter",
        }
        return frozenset(key for key, on in settings.items() if on)

    @model_validator(mode="after")
    def _batch_and_parallelism_keys(self) -> TrainSpec:
        # grad_accum = 1 is its default, and what spec.json holds beside a global_batch_size.
        if self.global_batch_size is not None and self.grad_accum != 1:
            raise ValueError(
                f"train.global_batch_size and train.grad_accum ({self.grad_accum}) are both set: grad_accum is "
                "derived from global_batch_size for each task's world size; remove one"
            )
        if self.shard_size is not None and not self.strategy.groups_by_node:
            raise ValueError(
                f"train.shard_size is only used with train.parallelism = 'hsdp' (it is '{self.parallelism}')"
            )
        refusal = self.strategy.refusal(self.turned_on())  # the run's own settings: RunSpec
        if refusal is not None:
            raise ValueError(refusal.text())
        return self

    @model_validator(mode="after")
    def _pipeline_keys(self) -> TrainSpec:
        if not self.strategy.pipelined:
            if self.pipeline is not None:
                raise ValueError(
                    f"[train.pipeline] is only used with train.parallelism = 'pipeline' (it is '{self.parallelism}')"
                )
            return self
        if self.pipeline is None:
            self.pipeline = PipelineSpec()
        return self

    @model_validator(mode="after")
    def _expert_parallel_keys(self) -> TrainSpec:
        if self.expert_parallel == 1:
            return self
        said = f"train.expert_parallel = {self.expert_parallel}"
        if not self.strategy.expert_parallel:
            takes = " or ".join(f"'{name}'" for name, entry in STRATEGIES.items() if entry.expert_parallel)
            raise ValueError(f"{said} needs train.parallelism = {takes} (it is '{self.parallelism}')")
        if self.optimizer_in_backward or self.cpu_offload:
            key = "optimizer_in_backward" if self.optimizer_in_backward else "cpu_offload"
            raise ValueError(f"{said} cannot be combined with train.{key} yet")
        return self

    @model_validator(mode="after")
    def _context_parallel_keys(self) -> TrainSpec:
        problem = context_parallel_problem(self.strategy, self.context_parallel, self.turned_on())
        if problem:
            raise ValueError(problem)
        return self

    def mesh(self, world_size: int, procs_per_node: int | Sequence[int]) -> Mesh:
        """The layout of a world of ``world_size`` ranks (jobgen.model.mesh), which
        :meth:`world_problem` found it fits; ``procs_per_node`` one count for every node, or
        each node's."""
        pipeline = self.pipeline if self.strategy.pipelined else None
        return mesh_of(
            self.parallelism,
            world_size,
            procs_per_node,
            shard_size=self.shard_size,
            context_parallel=self.context_parallel,
            expert_parallel=self.expert_parallel,
            pipeline_size=pipeline.pipeline_size(world_size) if pipeline else None,
            data_parallel=pipeline.data_parallel if pipeline else None,
        )

    def pipeline_size(self, world_size: int) -> int:
        """Ranks one pipeline spans (1 without a pipeline)."""
        if self.strategy.pipelined and self.pipeline is not None:
            return self.pipeline.pipeline_size(world_size)
        return 1

    def ranks_per_replica(self, world_size: int) -> int:
        """Ranks that read the same rows: a whole pipeline, or a context-parallel group
        (the mesh's pp x cp, which the nodes' shape does not change)."""
        return self.pipeline_size(world_size) * self.context_parallel

    def data_parallel_size(self, world_size: int) -> int:
        """Replicas that read different rows, in a world of ``world_size`` ranks."""
        return max(1, world_size // self.ranks_per_replica(world_size))

    def gradient_ranks(self, world_size: int) -> int:
        """Ranks each gradient is averaged over (DDP, FSDP): every rank but a pipeline's other
        stages, which hold other parameters. Context-parallel ranks hold shares of the same
        rows, so their gradients are averaged like replicas'."""
        return max(1, world_size // self.pipeline_size(world_size))

    def world_problem(self, world_size: int) -> tuple[str, str] | None:
        """(key, why) when this world cannot hold the layout; None when it can."""
        if world_size % self.context_parallel:
            return "train.context_parallel", (
                f"train.context_parallel = {self.context_parallel} must divide the world size {world_size}"
            )
        if world_size % self.expert_parallel:
            return "train.expert_parallel", (
                f"train.expert_parallel = {self.expert_parallel} must divide the world size {world_size}"
            )
        if self.pipeline is not None:
            return self.pipeline.world_problem(world_size, self.micro_batch_size)
        return None

    @model_validator(mode="after")
    def _optimizer_in_backward_combinations(self) -> TrainSpec:
        if not self.optimizer_in_backward:
            return self
        if self.global_batch_size is not None:
            raise ValueError(
                "train.optimizer_in_backward = true cannot take train.global_batch_size: it needs grad_accum = 1, "
                "so the global batch is micro_batch_size x world size"
            )
        if self.grad_accum > 1:
            raise ValueError(
                f"train.optimizer_in_backward = true needs train.grad_accum = 1 (it is {self.grad_accum}): the "
                "optimizer steps as soon as a gradient is ready, so gradients cannot be accumulated over "
                "micro-batches; raise micro_batch_size instead"
            )
        if self.grad_clip > 0 and self.grad_clip_mode == "global":
            raise ValueError(
                "train.optimizer_in_backward = true cannot clip by the global gradient norm (train.grad_clip = "
                f"{self.grad_clip:g} with train.grad_clip_mode = 'global'): no moment holds every gradient; set "
                "train.grad_clip = 0 or train.grad_clip_mode = 'per_parameter'"
            )
        return self
