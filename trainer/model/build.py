"""Load the model and tokenizer, add LoRA and activation checkpointing, wrap for DDP, FSDP2 or HSDP.

Order matters: LoRA adapters and gradient checkpointing are set up on the plain
module before it is wrapped, and checkpointing is always non-reentrant: the
reentrant variant re-runs forward hooks during backward and makes DDP raise
"Expected to mark a variable ready only once", most visibly together with LoRA.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from jobgen.model.pipeline_split import NodeMemory
from jobgen.spec.tables.model import ModelSpec
from jobgen.spec.tables.run import TrainSpec
from trainer.distributed import DistEnv
from trainer.model.errors import ModelError
from trainer.model.prep import (  # noqa: F401 - re-exported: trainer.model.build is where callers look
    DTYPES,
    add_lora,
    attention_implementation,
    compile_decoder_blocks,
    compiles_blocks,
    decoder_layers,
    load_tokenizer,
    param_dtype,
    prepare,
    trainable_parameters,
)
from trainer.parallel.strategies import strategy

log = logging.getLogger("trainer.model.build")


def load_model(spec: ModelSpec, device: torch.device, attention: str = "sdpa") -> torch.nn.Module:
    """The whole causal LM on ``device``, with LoRA and gradient checkpointing as the spec asks:
    for DDP, where every rank holds a replica anyway."""
    from transformers import AutoModelForCausalLM

    # A model directory may be a teammate's: its custom code never runs, and a .bin file is read
    # weights-only (transformers' defaults, stated so that no upgrade changes them unseen).
    model = AutoModelForCausalLM.from_pretrained(
        spec.path, dtype=param_dtype(spec, device), trust_remote_code=False, weights_only=True
    )
    return prepare(model, spec, attention).to(device)


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


def refuse_unsupported(spec: ModelSpec, train: TrainSpec) -> None:
    """ModelError before anything is loaded when train.parallelism cannot train this architecture
    (jobgen.model.parallelism's model refusals, which validate says of a local model too)."""
    from transformers import AutoConfig

    from trainer.model.architecture import model_traits

    if not train.strategy.refuses_models:
        return
    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=False)  # no code from the model directory
    refusal = train.strategy.model_refusal(model_traits(config))
    if refusal is not None:
        raise ModelError(f"train.parallelism = '{train.parallelism}': {spec.path}: {refusal}")


def wrap(model: torch.nn.Module, train: TrainSpec, env: DistEnv) -> torch.nn.Module:
    """``model`` wrapped as ``train.parallelism``'s entry in trainer.parallel.strategies says: DDP keeps a
    full replica per rank; FSDP2 makes each decoder block, the untied input and output
    embeddings and the root units sharded over every rank (fsdp) or over the ``shard``
    dimension of a 2-D mesh (hsdp)."""
    return strategy(train.parallelism).wrap(model, train, env)
