"""The data-parallel strategies as the trainer runs them: one entry per ``train.parallelism``,
keyed like :data:`jobgen.model.parallelism.STRATEGIES` (what each one shards, which the spec checks
and the memory plan read), saying how the trainer applies it:

- :attr:`Strategy.wrap`: how a model is wrapped;
- :attr:`Strategy.sync_context`: how a micro-step before the last skips the gradient sync;
- :attr:`Strategy.norm_group`: over which ranks the squared norms of gradient shards are
  summed (the grad norm that OptimizerInBackward sums in its hooks);
- :meth:`Strategy.param_device`: where the sharded parameters live (the host with
  ``train.cpu_offload``);
- :attr:`Strategy.build`: how the model is built when not by trainer.parallel.build's whole-model or
  sharded build (the pipeline's stages); :attr:`Strategy.data_shard`: which rows this rank
  reads (its replica's); :attr:`Strategy.runner`: how a step runs forward, backward and
  clipping (trainer.parallel.step_runner).

``ddp``: DistributedDataParallel, a whole replica per rank. ``fsdp``: FSDP2's ``fully_shard``
on every decoder layer, on the untied input and output embeddings, then on the root, over
every rank. ``hsdp``: the same ``fully_shard`` calls on a 2-D mesh ``(replicate, shard)``,
built once per process from the world torchrun formed (which can differ from the spec's on a
resume) and ``train.shard_size`` (default: the processes per node, torchrun's
LOCAL_WORLD_SIZE, which the batch script sets from ``job.procs_per_node``). Under HSDP every
replica holds the same shards, so a sum over shards is a sum over the ``shard`` dimension only.
``pipeline``: trainer/parallel/pipeline_steps.py (stages over ranks, replicas by FSDP2 or replicate).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from jobgen.model.mesh import mesh_of
from jobgen.model.parallelism import STRATEGIES as PLANS
from jobgen.model.parallelism import Parallelism, shard_size_problem
from jobgen.model.pipeline_split import NodeMemory
from jobgen.spec.tables.run import TrainSpec
from trainer.distributed import DistEnv
from trainer.model.errors import ModelError
from trainer.model.prep import decoder_layers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from jobgen.spec.tables.model import ModelSpec
    from trainer.parallel.context_parallel import ContextParallel
    from trainer.parallel.step_parts import StepParts
    from trainer.parallel.step_runner import StepRunner

log = logging.getLogger("trainer.parallel.strategies")

MESH_DIMS = ("replicate", "shard")


class ParallelismError(ModelError):
    """The spec's parallelism cannot run in this world or on this device; the message says what
    to change. A ModelError: every later task would fail the same way, so the run stops."""


class CpuOffloadUnavailable(ParallelismError):
    """``train.cpu_offload`` on a process that trains on the CPU."""


@dataclass(frozen=True)
class Strategy:
    """How the trainer applies one ``train.parallelism``."""

    plan: Parallelism  # jobgen's entry: what it shards
    wrap: Callable[[torch.nn.Module, TrainSpec, DistEnv], torch.nn.Module]
    sync_context: Callable[[torch.nn.Module, bool], contextlib.AbstractContextManager]
    norm_group: Callable[[list[torch.nn.Parameter]], dist.ProcessGroup | None]
    runner: Callable[[StepParts], StepRunner]  # given the Trainer's step parts (trainer.parallel.step_parts)
    data_shard: Callable[[TrainSpec, DistEnv], tuple[int, int]]
    # Builds the model itself (the pipeline); the last argument is each node's device memory.
    build: Callable[[ModelSpec, TrainSpec, DistEnv, bool, NodeMemory | None], torch.nn.Module] | None = None

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def loads_sharded(self) -> bool:
        """Built on the meta device, sharded, each rank reading its slices (trainer.model.sharded_load)."""
        return self.plan.shards_parameters

    def check(self, train: TrainSpec, env: DistEnv) -> None:
        """Refuse, before anything is loaded, what this strategy cannot do in this process."""
        if train.cpu_offload and env.device.type != "cuda":
            raise CpuOffloadUnavailable(
                f"train.cpu_offload = true needs a GPU, and this process trains on the {env.device.type}: "
                "without a GPU the parameters, gradients and optimizer state are in host memory already, and "
                "FSDP's CPU offload would only add copies; set train.cpu_offload = false or run on a GPU site"
            )
        if train.cpu_offload and not self.plan.shards_parameters:
            raise ParallelismError(f"train.cpu_offload = true needs parallelism 'fsdp' or 'hsdp', not '{self.name}'")
        if not self.plan.shards_parameters and train.optimizer_in_backward and env.world_size != 1:
            # Validation allows this on one process only; a world of another size would step
            # every rank on its own gradient (DDP's hooks fire before its all-reduce).
            raise ParallelismError(
                f"train.optimizer_in_backward with parallelism = 'ddp' needs a world of one process, this one "
                f"has {env.world_size}: set job.nodes = 1 and job.procs_per_node = 1, or parallelism = 'fsdp'"
            )
        if self.plan.groups_by_node:
            hsdp_shape(env, train.shard_size)

    def param_device(self, train: TrainSpec, env: DistEnv) -> torch.device:
        """Where this rank's parameter shards are allocated: the host with CPU offload (FSDP2
        copies each unit to the GPU for its forward and backward), the rank's device otherwise."""
        return torch.device("cpu") if train.cpu_offload and self.plan.shards_parameters else env.device


# ---------------------------------------------------------------- wrapping


def _wrap_ddp(model: torch.nn.Module, train: TrainSpec, env: DistEnv) -> torch.nn.Module:
    if train.optimizer_in_backward:
        # One process (Strategy.check): DDP would add nothing but its gradient buckets, which
        # hold a copy of every gradient (and write them back after the hooks freed them).
        # Checkpoint keys are the same with and without DDP.
        return model
    return DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)


def _fully_shard(model: torch.nn.Module, train: TrainSpec, env: DistEnv, mesh: DeviceMesh | None) -> torch.nn.Module:
    """FSDP2 shards each block's parameters, gradients and optimizer state (fully_shard per
    block, then the root), over every rank or, with ``mesh``, over its ``shard`` dimension.

    Untied input and output embeddings are units of their own, as in torchtitan: inside the
    root they would stay gathered, with their unsharded gradients, from the first forward
    to the end of backward (2 x vocabulary x hidden x 2 tensors on every rank; 250 MiB of
    the 374M Llama's backward peak on CPU). The output layer runs last in forward and first
    in backward, so it is not resharded in between. Tied embeddings share one parameter
    and stay in the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, object] = {}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if env.device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if train.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    if train.expert_parallel > 1:
        # The experts first: their own units on the (edp, ep) mesh, which the blocks' units leave out.
        from trainer.parallel.expert_parallel import ExpertParallel

        ep = ExpertParallel.for_world(train, env)
        assert ep is not None
        ep.install(model, {k: v for k, v in kwargs.items() if k != "mesh"})
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is not None and head is not None and head.weight is not embed.weight:
        fully_shard(embed, **kwargs)
        fully_shard(head, reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _wrap_fsdp(model: torch.nn.Module, train: TrainSpec, env: DistEnv) -> torch.nn.Module:
    return _fully_shard(model, train, env, None)


def _wrap_hsdp(model: torch.nn.Module, train: TrainSpec, env: DistEnv) -> torch.nn.Module:
    return _fully_shard(model, train, env, hsdp_mesh(env, train.shard_size))


def hsdp_shape(env: DistEnv, shard_size: int | None) -> tuple[int, int]:
    """(replicas, shard size) of this world: ``shard_size`` ranks per copy (default the
    processes per node). The loader checked the spec's world sizes; this is the world torchrun
    formed, which a resume on other nodes can change."""
    problem = shard_size_problem("hsdp", env.world_size, env.local_world_size, shard_size)
    if problem:
        raise ParallelismError(f"this task's world: {problem}")
    mesh = mesh_of("hsdp", env.world_size, env.local_world_size, shard_size=shard_size)
    return mesh.replicate, mesh.shard


def hsdp_mesh(env: DistEnv, shard_size: int | None) -> DeviceMesh:
    """The 2-D mesh ``(replicate, shard)`` of this world, built once per process."""
    return _device_mesh(env.device.type, hsdp_shape(env, shard_size))


@functools.cache
def _device_mesh(device_type: str, shape: tuple[int, int]) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    # Rank r is replica r // shard_size, shard r % shard_size: a node's ranks shard one copy.
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    log.info("hsdp: %d replica(s) of the model, each sharded over %d rank(s)", *shape)
    return mesh


# ---------------------------------------------------------------- gradient sync


def _ddp_sync(model: torch.nn.Module, last_micro: bool) -> contextlib.AbstractContextManager:
    # Not wrapped with optimizer_in_backward on one process: nothing to skip.
    if last_micro or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def _fsdp_sync(model: torch.nn.Module, last_micro: bool) -> contextlib.AbstractContextManager:
    # Neither reduce-scatter nor all-reduce before the last micro-step: each rank accumulates
    # its unsharded gradients, and the last micro-step reduce-scatters their sum.
    model.set_requires_gradient_sync(last_micro)
    return contextlib.nullcontext()


def _hsdp_sync(model: torch.nn.Module, last_micro: bool) -> contextlib.AbstractContextManager:
    # Reduce-scatter within the shard group on every micro-step (the node's own links), so the
    # accumulated gradients stay sharded; the all-reduce across replicas (the network) runs on
    # the last micro-step only, on the sum FSDP2 kept of the earlier ones.
    model.set_requires_all_reduce(last_micro)
    return contextlib.nullcontext()


# ---------------------------------------------------------------- gradient norm


def _mesh_of(params: list[torch.nn.Parameter]) -> DeviceMesh | None:
    return next((p.device_mesh for p in params if hasattr(p, "device_mesh")), None)


def _no_group(params: list[torch.nn.Parameter]) -> dist.ProcessGroup | None:
    return None  # DDP: every rank holds the whole averaged gradient


def _whole_mesh(params: list[torch.nn.Parameter]) -> dist.ProcessGroup | None:
    mesh = _mesh_of(params)
    return mesh.get_group() if mesh is not None else None


def _shard_dimension(params: list[torch.nn.Parameter]) -> dist.ProcessGroup | None:
    # The replicas hold the same shards: summing over the world would count each one
    # `replicas` times.
    mesh = _mesh_of(params)
    return mesh.get_group("shard") if mesh is not None else None


def _refuse_in_backward(params: list[torch.nn.Parameter]) -> dist.ProcessGroup | None:
    raise ParallelismError("train.optimizer_in_backward cannot run with parallelism = 'pipeline'")


# ---------------------------------------------------------------- steps, data, building


def _data_parallel_steps(parts: StepParts) -> StepRunner:
    from trainer.parallel.step_runner import DataParallelSteps

    return DataParallelSteps(parts, STRATEGIES[parts.train.parallelism].sync_context)


def _every_rank_its_rows(train: TrainSpec, env: DistEnv) -> tuple[int, int]:
    # A context-parallel group's cp consecutive ranks read the same rows, each a share of them.
    return train.mesh(env.world_size, env.local_world_size).data_shard(env.rank)


def context_parallel_for(train: TrainSpec, env: DistEnv) -> ContextParallel | None:
    """This rank's context-parallel group (ranks r - r % cp .. + cp - 1, one node's when cp
    divides its processes: the mesh's ``cp`` degree), or None when the degree is 1."""
    degree = train.mesh(env.world_size, env.local_world_size).cp
    if degree == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.context_parallel import ContextParallel

    problem = train.world_problem(env.world_size)
    if problem:  # the loader checked the spec's worlds; a resume may have formed another
        raise ParallelismError(f"this task's world: {problem[1]}")
    shape = (env.world_size // degree, degree)
    mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=("dp", "cp"))
    return ContextParallel(mesh.get_group("cp"))


def _pipeline_steps(parts: StepParts) -> StepRunner:
    from trainer.parallel.pipeline_steps import PipelineSteps

    return PipelineSteps(parts)


def _replica_rows(train: TrainSpec, env: DistEnv) -> tuple[int, int]:
    from trainer.parallel.pipeline_steps import data_shard

    return data_shard(train, env)


def _build_pipeline(
    spec: ModelSpec, train: TrainSpec, env: DistEnv, packing: bool, nodes: NodeMemory | None
) -> torch.nn.Module:
    from trainer.parallel.pipeline_steps import build_pipeline_model

    return build_pipeline_model(spec, train, env, packing, nodes)


def _no_wrap(model: torch.nn.Module, train: TrainSpec, env: DistEnv) -> torch.nn.Module:
    return model  # the pipeline's build wraps each stage over its replicas


def _no_sync_switch(model: torch.nn.Module, last_micro: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()  # the schedule syncs its stages' gradients itself


STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy(PLANS["ddp"], _wrap_ddp, _ddp_sync, _no_group, _data_parallel_steps, _every_rank_its_rows),
    "fsdp": Strategy(PLANS["fsdp"], _wrap_fsdp, _fsdp_sync, _whole_mesh, _data_parallel_steps, _every_rank_its_rows),
    "hsdp": Strategy(
        PLANS["hsdp"], _wrap_hsdp, _hsdp_sync, _shard_dimension, _data_parallel_steps, _every_rank_its_rows
    ),
    "pipeline": Strategy(
        PLANS["pipeline"],
        _no_wrap,
        _no_sync_switch,
        _refuse_in_backward,
        _pipeline_steps,
        _replica_rows,
        build=_build_pipeline,
    ),
}
assert STRATEGIES.keys() == PLANS.keys(), "one trainer entry per jobgen strategy"


def strategy(name: str) -> Strategy:
    return STRATEGIES[name]
