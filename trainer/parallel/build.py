"""The model ready to train, as ``train.parallelism``'s entry in trainer.parallel.strategies builds
and wraps it: the trainer's one call (:func:`build_model`), above the model it loads
(trainer.model: the whole model, the sharded build, LoRA and checkpointing) and the strategies'
table it follows.

Order matters: LoRA adapters and gradient checkpointing are set up on the plain
module before it is wrapped, and checkpointing is always non-reentrant: the
reentrant variant re-runs forward hooks during backward and makes DDP raise
"Expected to mark a variable ready only once", most visibly together with LoRA.
"""

from __future__ import annotations

from typing import Any

import torch

from jobgen.model.pipeline_split import NodeMemory
from jobgen.spec.tables.model import ModelSpec
from jobgen.spec.tables.run import TrainSpec
from trainer.distributed import DistEnv
from trainer.model.build import load_model, refuse_unsupported
from trainer.model.prep import attention_implementation, compile_decoder_blocks, compiles_blocks, param_dtype, prepare
from trainer.parallel.strategies import strategy


def build_model(
    spec: ModelSpec,
    train: TrainSpec,
    env: DistEnv,
    *,
    packing: bool = False,
    context: Any = None,
    nodes: NodeMemory | None = None,
) -> torch.nn.Module:
    """The model ready to train, as ``train.parallelism``'s entry in trainer.parallel.strategies says.
    DDP: loaded whole and replicated. FSDP and HSDP: built on the meta device, sharded, and
    each rank reads only its shards from the safetensors (trainer.model.sharded_load), so no rank
    ever holds the whole model; with ``train.cpu_offload`` the shards live in host memory.
    Decoder blocks are compiled before wrapping (train.compile). What the strategy cannot do
    in this process (CPU offload without a GPU, an HSDP shard size that does not divide this
    world) is refused before anything is loaded (the Trainer has asked before reading the data).
    ``context``: a trainer.parallel.context_parallel.ContextParallel whose attention the model runs
    (installed after the spec's preparation, before wrapping). ``nodes``: each node's device
    memory (job.device_memory), which a pipeline's stages follow."""
    chosen = strategy(train.parallelism)
    chosen.check(train, env)
    refuse_unsupported(spec, train)
    if chosen.build is not None:
        return chosen.build(spec, train, env, packing, nodes)
    attention = attention_implementation(spec, env.device, packing)
    compile_blocks = compiles_blocks(train, env.device)

    def ready(model: torch.nn.Module) -> torch.nn.Module:
        if context is not None:
            context.install(model)
        return wrap(compile_decoder_blocks(model) if compile_blocks else model, train, env)

    if not chosen.loads_sharded:
        return ready(load_model(spec, env.device, attention))
    from trainer.model.sharded_load import build_sharded

    return build_sharded(
        spec,
        env,
        param_dtype(spec, env.device),
        prepare=lambda model: prepare(model, spec, attention),
        shard=ready,
        param_device=chosen.param_device(train, env),
    )


def wrap(model: torch.nn.Module, train: TrainSpec, env: DistEnv) -> torch.nn.Module:
    """``model`` wrapped as ``train.parallelism``'s entry in trainer.parallel.strategies says: DDP keeps a
    full replica per rank; FSDP2 makes each decoder block, the untied input and output
    embeddings and the root units sharded over every rank (fsdp) or over the ``shard``
    dimension of a 2-D mesh (hsdp)."""
    return strategy(train.parallelism).wrap(model, train, env)
