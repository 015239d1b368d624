"""A bare Hugging Face model made ready to train, before any parallelism touches it: its
dtype, tokenizer, attention kernel, KV cache off, activation checkpointing, LoRA adapters,
compiled blocks; and the lookups every strategy shares (its decoder blocks, its trainable
parameters). Below trainer.model.build (the whole model), trainer.parallel.build (the sharded build),
trainer.parallel.strategies and trainer.parallel.pipeline_steps, which all use it.

Order matters: LoRA adapters and gradient checkpointing are set up on the plain
module before it is wrapped, and checkpointing is always non-reentrant: the
reentrant variant re-runs forward hooks during backward and makes DDP raise
"Expected to mark a variable ready only once", most visibly together with LoRA.
"""

from __future__ import annotations

import logging

import torch

from jobgen.spec.tables.model import ModelSpec
from jobgen.spec.tables.run import TrainSpec
from trainer.model.architecture import Architecture
from trainer.model.errors import ModelError

log = logging.getLogger("trainer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def param_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    # CPU runs train in float32: bf16 matmuls there are slow and numerically poorer.
    return DTYPES[spec.dtype] if device.type == "cuda" else torch.float32


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # a tokenizer's own code never runs
    if tokenizer.pad_token is None and tokenizer.eos_token is None:
        # Refused here, in the job's first seconds and before the data and the model load:
        # without eos no example is taught to end, and without pad the first unpacked
        # batch fails in collate with a bare TypeError.
        raise ModelError(
            f"model.path: {path}: the tokenizer has neither a pad token nor an eos token; add one "
            '(e.g. "eos_token": "</s>" in its tokenizer_config.json, naming a token of its vocabulary, '
            "or tokenizer.add_special_tokens({'eos_token': ...}) then save_pretrained)"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attention_implementation(spec: ModelSpec, device: torch.device, packing: bool) -> str:
    """``model.attention`` resolved for the model's class (trainer.model.architecture): "auto" is
    flex attention for packed rows on a GPU, SDPA otherwise, each where the class supports it,
    else eager (Gemma 2 has no SDPA). Logged with the reason."""
    if spec.attention != "auto":
        return spec.attention  # what the user chose stands
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=False)  # no code from the model directory
    chosen, why = Architecture.of_config(config).attention(spec.attention, device.type == "cuda", packing)
    log.info("attention: %s (%s)", chosen, why)
    return chosen


def compiles_blocks(train: TrainSpec, device: torch.device) -> bool:
    """``train.compile`` resolved: unset means on for GPUs, off on CPU."""
    return train.compile if train.compile is not None else device.type == "cuda"


def prepare(model: torch.nn.Module, spec: ModelSpec, attention: str = "sdpa") -> torch.nn.Module:
    """What the spec changes on the bare model, before any wrapping: the attention kernel,
    no KV cache, checkpointing, LoRA adapters."""
    if model.config._attn_implementation != attention:
        model.set_attn_implementation(attention)
    model.config.use_cache = False  # no KV cache while training; it also conflicts with checkpointing
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora is not None:
        model = add_lora(model, spec)
    return model


def compile_decoder_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile each decoder block in place (``Module.compile``), as torchtitan does: one
    small graph per block, reused by every block of the same shape, and the blocks stay the
    modules FSDP2 shards and checkpointing wraps. The output layer and the loss head stay
    eager: they are swapped and hooked at run time (trainer.memory.chunked_loss)."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    log.info("compiled decoder blocks: %d (train.compile)", len(layers))
    return model


def add_lora(model: torch.nn.Module, spec: ModelSpec) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RuntimeError("model.lora needs peft: pip install 'jobgen[lora]'") from None
    assert spec.lora is not None
    experts = Architecture.of_model(model).expert_parameters(model) if spec.lora.target_experts else []
    if experts:
        log.info("LoRA adapts the routed experts' %s too (model.lora.target_experts)", ", ".join(experts))
    config = LoraConfig(
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        target_modules=lora_targets(model, spec),
        target_parameters=experts or None,
        task_type="CAUSAL_LM",
    )
    if spec.gradient_checkpointing:
        # With frozen embeddings no checkpointed input requires grad; make them carry it.
        model.enable_input_require_grads()
    adapted = get_peft_model(model, config)
    if not spec.lora.target_experts and any(type(m).__name__ == "ParamWrapper" for m in adapted.modules()):
        # A target peft took as the experts' (validate refuses it for a local model; a hub id skips that).
        raise ModelError(
            "model.lora.target_modules names layers that peft adapts as the routed experts' fused weights: "
            "set model.lora.target_experts = true, or leave target_modules unset"
        )
    return adapted


def lora_targets(model: torch.nn.Module, spec: ModelSpec) -> list[str] | str:
    """``[model.lora] target_modules``: a list of names, or one string ('all-linear' or a regular
    expression: jobgen.model.lora_targets); unset, every linear layer of the decoder blocks
    (trainer.model.architecture), logged."""
    assert spec.lora is not None
    targets = spec.lora.target_modules
    if targets is None:
        targets = Architecture.of_model(model).lora_targets(model)
        log.info("LoRA adapts %s of every decoder layer (model.lora.target_modules unset)", ", ".join(targets))
        return targets
    return targets if isinstance(targets, str) else list(targets)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, as the model's class names them (its ``_no_split_modules``:
    LlamaDecoderLayer, GPTNeoXLayer, GPT2Block, ...); ModelError when it names none it has."""
    return Architecture.of_model(model).decoder_layers(model)
