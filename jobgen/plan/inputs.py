"""What of a run the memory plan reads: :class:`PlanInputs`, everything of the spec that
changes one rank's memory, in one place (jobgen.plan.memory_plan.inputs_for builds them from a
resolved spec; the suggestions vary them), with [train.pipeline] as :class:`PipelineInputs`.
Its layout and what it has turned on are the same descriptions the spec and the trainer read:
the mesh (jobgen.model.mesh) and the settings a parallelism may refuse
(jobgen.model.parallelism)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jobgen.model.mesh import Mesh, mesh_of
from jobgen.model.parallelism import (
    ACTIVATION_OFFLOADING,
    CPU_OFFLOAD,
    IN_BACKWARD,
    LORA,
    LOSS_CHUNKS,
    PER_PARAMETER_CLIP,
    SEVERAL_PROCESSES,
    STRATEGIES,
    Parallelism,
)
from jobgen.plan.nccl import NcclSettings

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PipelineInputs:
    """[train.pipeline] as the estimate reads it (jobgen.spec.tables.pipeline.PipelineSpec's keys)."""

    size: int | None = None  # ranks per pipeline (None: the world)
    stages: int | None = None  # None: one per pipeline rank (two for the multi-stage schedules)
    schedule: str = "1f1b"
    microbatches: int | None = None  # pieces each micro-batch is split into (None: micro_batch_size)
    layers_per_stage: tuple[int, ...] | None = None
    data_parallel: str = "fsdp"  # how the world / size replicas combine: "fsdp" or "ddp"


@dataclass(frozen=True)
class PlanInputs:
    """Everything of the spec that changes memory, in one place (suggestions vary these)."""

    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "bfloat16"  # model.dtype (CPU ranks use float32 regardless)
    parallelism: str = "ddp"
    world_size: int = 1
    nodes: int = 1
    # job.procs_per_node as a list: each node's ranks; empty: world_size / nodes on each.
    node_procs: tuple[int, ...] = ()
    # job.device_memory in bytes, node by node; empty: the site's device_memory on every node.
    node_memory: tuple[int, ...] = ()
    micro_batch_size: int = 1
    seq_len: int = 1024
    grad_accum: int = 1
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    activation_offloading: bool = False
    optimizer_in_backward: bool = False
    loss_chunk_tokens: int = 0
    # train.grad_clip_mode = "per_parameter" with grad_clip > 0 (a pipeline refuses it)
    per_parameter_clip: bool = False
    # train.grad_clip > 0 with grad_clip_mode = "global" (optimizer_in_backward refuses it)
    global_clip: bool = False
    lora_r: int | None = None
    lora_targets: tuple[str, ...] = ()
    attn_implementation: str = "sdpa"
    shard_size: int | None = None  # train.shard_size (hsdp)
    cpu_offload: bool = False
    global_batch_size: int | None = None  # train.global_batch_size: grad_accum follows the world
    nccl: NcclSettings = field(default_factory=NcclSettings)  # the site's network and NCCL variables
    pipeline: PipelineInputs | None = None  # [train.pipeline] when parallelism is "pipeline"
    context_parallel: int = 1  # train.context_parallel; seq_len is then one rank's share of a row
    expert_parallel: int = 1  # train.expert_parallel: ranks each MoE layer's experts are split over

    @property
    def param_bytes(self) -> int:
        return 4 if self.device == "cpu" else DTYPE_BYTES[self.dtype]

    @property
    def act_bytes(self) -> int:
        """Activation dtype: float32 on CPU, bf16 under the GPU's autocast."""
        return 4 if self.device == "cpu" else 2

    @property
    def ranks_per_node(self) -> int:
        """The most ranks on one node: the node whose host memory fills first."""
        return max(self.node_procs) if self.node_procs else max(1, self.world_size // max(1, self.nodes))

    @property
    def procs_of_nodes(self) -> tuple[int, ...]:
        """Each node's ranks, node by node: the list, else world_size / nodes on each."""
        return self.node_procs or (self.world_size // max(1, self.nodes),) * self.nodes

    @property
    def strategy(self) -> Parallelism:
        """The parallelism's entry: what it shards and refuses, whether it is a pipeline."""
        return STRATEGIES[self.parallelism]

    @property
    def mesh(self) -> Mesh:
        """The run's layout (jobgen.model.mesh), as the spec and the trainer build it."""
        pipe = self.pipeline if self.strategy.pipelined else None
        return mesh_of(
            self.parallelism,
            self.world_size,
            self.node_procs or self.ranks_per_node,
            shard_size=self.shard_size,
            context_parallel=self.context_parallel,
            expert_parallel=self.expert_parallel,
            pipeline_size=pipe.size if pipe else None,
            data_parallel=pipe.data_parallel if pipe else None,
        )

    @property
    def shard(self) -> int:
        """Ranks one copy of the model's states is split over (1 for DDP)."""
        return self.mesh.shard

    def turned_on(self) -> frozenset[str]:
        """The settings of these inputs that a parallelism or the context-parallel degree may
        refuse (jobgen.model.parallelism names them), of those that are on."""
        settings = {
            CPU_OFFLOAD: self.cpu_offload,
            IN_BACKWARD: self.optimizer_in_backward,
            LOSS_CHUNKS: self.loss_chunk_tokens > 0,
            PER_PARAMETER_CLIP: self.per_parameter_clip,
            LORA: self.lora_r is not None,
            ACTIVATION_OFFLOADING: self.activation_offloading,
            SEVERAL_PROCESSES: self.world_size > 1,
        }
        return frozenset(key for key, on in settings.items() if on)

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the states (over more than one rank)."""
        return self.shard > 1

    @property
    def offloaded(self) -> bool:
        """FSDP2 keeps the states in host memory (cpu_offload on a GPU site)."""
        return self.cpu_offload and self.device == "cuda" and self.strategy.shards_parameters
