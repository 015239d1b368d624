"""Tiny random causal LMs of the families users fine-tune, built here with transformers' own
configuration classes (nothing downloaded): hidden 64, 2 layers, grouped-query attention, the
tokenizer of ``jobgen make-tiny-model``. Each is saved with ``save_pretrained``, so the files
have the layout the hub has (per-expert MoE weights, GPT-NeoX's ``embed_out``, tied heads
left out).

    make_family_model(directory, "gemma2") -> directory
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

# family -> (transformers model_type, what differs from COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mistral-sliding": ("mistral", {"sliding_window": 8}),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": 8}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": 8}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "gpt-neox": ("gpt_neox", {}),
    # GPT-2 trains with dropout by default (0.1): off, so that 2 ranks and 1 process compute the same.
    "gpt2": ("gpt2", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    ),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    # MLA attention (low-rank q and kv), a dense first layer, then routed and shared experts.
    "deepseek-v3": (
        "deepseek_v3",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "num_key_value_heads": 4,
        },
    ),
    # Attention sinks, biases, alternating sliding and full attention, experts with biases.
    "gpt-oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # Granite 4.0-H: a Mamba2 layer, then an attention layer, each with routed experts and a shared MLP.
    "granite-4-h": (
        "granitemoehybrid",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_expand": 2,
            "mamba_chunk_size": 64,
        },
    ),
    # SmolLM3: no rotary positions in every 4th layer (NoPE), tied embeddings.
    "smollm3": ("smollm3", {"tie_word_embeddings": True}),
}


@functools.cache
def _tokenizer():
    """The tiny tokenizer, trained once per process for every family (it is only saved)."""
    from jobgen.cli.tinymodel import train_tokenizer

    return train_tokenizer(512)


def make_family_model(directory: Path, family: str, *, seed: int = 0) -> Path:
    """A random ``family`` model and the tiny tokenizer, saved into ``directory`` (created)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    tokenizer = _tokenizer()
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = AutoConfig.for_model(model_type, **{**COMMON, **ids, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    model.save_pretrained(directory)
    return directory
