"""What a model's config.json says of its architecture that decides whether a parallelism can
train it and which attention kernel "auto" runs: its family (``model_type``), tied input and
output embeddings, routed experts.

Read the same way by ``jobgen validate`` and ``jobgen plan`` (config.json, without torch) and by
the trainer (its ``PretrainedConfig.to_dict()``), so a refusal in jobgen.model.parallelism's
table is one text, said before the job queues and again, should the check have been skipped (a
hub id), as the job builds its model.

    traits = ModelTraits.of_config(json.loads(config_text), tied=info.tie_word_embeddings)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# A decoder block's index in a tensor or module name (Llama's ``layers.3.``, GPT-2's ``h.3.``).
BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")

# The config keys different families count their routed experts by (Mixtral, Qwen2-MoE and
# OLMoE, DeepSeek).
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")

# The causal LMs of transformers (5.24) whose class lacks an attention kernel
# (``_supports_sdpa``, ``_supports_flex_attn`` false), by model_type: what ``jobgen plan`` sizes
# "auto" by without importing transformers. The trainer reads the class itself
# (trainer.model.architecture); tests/unit/test_model_traits.py checks this table against it.
WITHOUT_SDPA = frozenset(
    [
        "big_bird",
        "bigbird_pegasus",
        "bloom",
        "cpmant",
        "deepseek_v4",
        "falcon_mamba",
        "flint",
        "gemma2",
        "git",
        "got_ocr2",
        "gpt_neo",
        "gpt_neox_japanese",
        "gpt_oss",
        "granite_swa",
        "granitemoe_swa",
        "hy_v4",
        "inkling2_loop_text",
        "inkling2_text",
        "mamba",
        "mamba2",
        "megatron-bert",
        "mimo_v2_flash",
        "mpt",
        "mvp",
        "openai-gpt",
        "prophetnet",
        "reformer",
        "rembert",
        "roformer",
        "rwkv",
        "trocr",
        "vaultgemma",
        "xglm",
        "xlm",
        "xlnet",
        "xlstm",
    ]
)
WITHOUT_FLEX = frozenset(
    [
        "aria_text",
        "axk2",
        "bailing_hybrid",
        "bamba",
        "big_bird",
        "bigbird_pegasus",
        "bloom",
        "blt",
        "cohere_compass_text",
        "cpmant",
        "deepseek_v32",
        "deepseek_v4",
        "dots3_note",
        "dots3_note_text",
        "falcon",
        "falcon_h1",
        "falcon_mamba",
        "gemma4_assistant",
        "gemma4_unified_assistant",
        "git",
        "glm_moe_dsa",
        "got_ocr2",
        "gpt-sw3",
        "gpt2",
        "gpt_bigcode",
        "gpt_neo",
        "gpt_neox_japanese",
        "hy_v4",
        "inkling2_loop_text",
        "inkling2_text",
        "jamba",
        "kimi_linear",
        "lara_mini",
        "mamba",
        "mamba2",
        "megatron-bert",
        "mimo_v2_flash",
        "minimax_m3_vl_text",
        "moss_transcribe_diarize",
        "mpt",
        "mvp",
        "olmo_hybrid",
        "olmoe",
        "openai-gpt",
        "persimmon",
        "prophetnet",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_next",
        "qwen4_exp",
        "qwen4_exp_text",
        "reformer",
        "rembert",
        "roformer",
        "rwkv",
        "stablelm",
        "trocr",
        "xglm",
        "xlm",
        "xlnet",
        "xlstm",
        "zamba",
    ]
)


def resolve_attention(choice: str, *, gpu: bool, packing: bool, sdpa: bool, flex: bool, name: str) -> tuple[str, str]:
    """``model.attention`` resolved, and why: "auto" is flex attention for packed rows on a GPU
    (a block mask per document instead of SDPA's dense rows x rows mask), SDPA otherwise, each
    where the model (``name``) supports it (``sdpa``, ``flex``), else eager. The trainer's rule
    (from the class) and the plan's (from the model type) alike."""
    if choice != "auto":
        return choice, "as model.attention says"
    if gpu and packing and flex:
        return "flex_attention", "packed rows on a GPU"
    if sdpa:
        return "sdpa", "the default"
    return "eager", f"{name} does not support SDPA"


# Sequence mixers that are no attention: a Mamba scan, linear attention, a short convolution.
# Context parallelism splits attention only; such a layer would run on a share of each row
# as if it were the whole. By the layer types a hybrid's config lists, or by the model type.
RECURRENT_LAYER_TYPES = frozenset(["mamba", "mamba2", "linear_attention", "conv", "recurrent"])
RECURRENT_MODEL_TYPES = frozenset(
    [
        "bamba",
        "falcon_h1",
        "falcon_mamba",
        "granitemoehybrid",
        "jamba",
        "kimi_linear",
        "lfm2",
        "mamba",
        "mamba2",
        "nemotron_h",
        "olmo_hybrid",
        "qwen3_next",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "zamba",
        "zamba2",
    ]
)
# Attention with learned sinks (gpt-oss's per-head ``sinks``), which the context-parallel
# attention does not compute.
SINK_MODEL_TYPES = frozenset(["gpt_oss"])


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (a multimodal one nests it in ``text_config``)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def expert_count(config: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer; 0 for a dense model."""
    text = text_config(config)
    return next((int(text[key]) for key in EXPERT_KEYS if text.get(key)), 0)


@dataclass(frozen=True)
class ModelTraits:
    """The facts of an architecture that jobgen.model.parallelism's refusals read."""

    model_type: str
    tied_embeddings: bool
    experts: int  # routed experts per MoE layer; 0 for a dense model
    recurrent: bool = False  # some layers mix the sequence by a scan (Mamba, linear attention)
    attention_sinks: bool = False
    router_aux_loss: bool = False  # the config asks for the router's load-balancing loss

    def attention(self, choice: str, *, gpu: bool, packing: bool) -> str:
        """The kernel the trainer will run for ``model.attention = choice`` (:func:`resolve_attention`)."""
        kernel, _ = resolve_attention(
            choice,
            gpu=gpu,
            packing=packing,
            sdpa=self.model_type not in WITHOUT_SDPA,
            flex=self.model_type not in WITHOUT_FLEX,
            name=self.model_type,
        )
        return kernel

    @classmethod
    def of_config(cls, config: Mapping[str, Any], *, tied: bool) -> ModelTraits:
        """``config``: config.json's object (or ``PretrainedConfig.to_dict()``); ``tied``: whether
        the head is the embedding's weight, which the caller knows with the family's default
        (config.json may leave it out)."""
        text = text_config(config)
        model_type = str(text.get("model_type") or config.get("model_type") or "")
        layer_types = text.get("layer_types") or ()
        return cls(
            model_type=model_type,
            tied_embeddings=tied,
            experts=expert_count(config),
            recurrent=model_type in RECURRENT_MODEL_TYPES or bool(RECURRENT_LAYER_TYPES & set(layer_types)),
            attention_sinks=model_type in SINK_MODEL_TYPES,
            router_aux_loss=bool(text.get("output_router_logits")) and float(text.get("router_aux_loss_coef") or 0) > 0,
        )
