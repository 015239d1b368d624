"""Load the model and tokenizer, add LoRA and activation checkpointing, and refuse what
``train.parallelism`` cannot train, before any parallelism touches the model: trainer.parallel.build
(above the strategies' table) wraps it for DDP, FSDP2 or HSDP, or builds a pipeline's stages.
"""

from __future__ import annotations

import logging

import torch

from jobgen.spec.tables.model import ModelSpec
from jobgen.spec.tables.run import TrainSpec
from trainer.model.errors import ModelError
from trainer.model.mxfp4 import is_mxfp4
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

log = logging.getLogger("trainer.model.build")


def load_model(spec: ModelSpec, device: torch.device, attention: str = "sdpa") -> torch.nn.Module:
    """The whole causal LM on ``device``, with LoRA and gradient checkpointing as the spec asks:
    for DDP, where every rank holds a replica anyway."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # A model directory may be a teammate's: its custom code never runs, and a .bin file is read
    # weights-only (transformers' defaults, stated so that no upgrade changes them unseen).
    extra = {}
    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=False)
    if is_mxfp4(config):  # gpt-oss as published: its experts dequantized to the training dtype
        from transformers import Mxfp4Config

        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        spec.path, dtype=param_dtype(spec, device), trust_remote_code=False, weights_only=True, **extra
    )
    return prepare(model, spec, attention).to(device)


def refuse_unsupported(spec: ModelSpec, train: TrainSpec) -> None:
    """ModelError before anything is loaded when train.parallelism cannot train this architecture
    (jobgen.model.parallelism's model refusals, which validate says of a local model too)."""
    from transformers import AutoConfig

    from jobgen.model.mesh import context_parallel_model_refusal
    from trainer.model.architecture import model_traits

    if not train.strategy.refuses_models and train.context_parallel == 1:
        return
    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=False)  # no code from the model directory
    traits = model_traits(config)
    refusal = train.strategy.model_refusal(traits)
    if refusal is not None:
        raise ModelError(f"train.parallelism = '{train.parallelism}': {spec.path}: {refusal}")
    unsplit = context_parallel_model_refusal(train.context_parallel, traits)
    if unsplit is not None:
        raise ModelError(f"train.context_parallel = {train.context_parallel}: {spec.path}: {unsplit}")
