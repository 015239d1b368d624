"""The ``[model]`` table of run.toml and its ``[model.lora]``: the model to fine-tune, its dtype,
memory options, attention kernel and adapters. What a local model's files hold is checked
against it in :mod:`jobgen.spec.named_files`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from jobgen.model.lora_targets import is_all_linear
from jobgen.spec.fields import SpecModel


class LoraSpec(SpecModel):
    """Low-rank adapters through peft (pip install .[lora])."""

    r: int = Field(16, ge=1, le=4096, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="Scaling (lora_alpha).")
    dropout: float = Field(
        0.05,
        ge=0,
        lt=1,
        description=(
            "Dropout on the adapter input. With target_experts it is 0 (peft adapts fused expert weights without "
            "dropout), and another value is refused."
        ),
    )
    target_modules: list[str] | str | None = Field(
        None,
        description=(
            "The layers to adapt, by peft's rules: a list of module names, each matching a layer whose full name "
            "is it or ends in '.' and it (['q_proj', 'v_proj'], ['self_attn.o_proj']); or one string: 'all-linear' "
            "(every linear layer but the output layer) or a regular expression the whole name must match "
            "('.*\\.(q|v)_proj'). Unset: every linear layer of the decoder blocks, whatever the architecture calls "
            "them (Llama's q/k/v/o and MLP projections, Phi-3's fused qkv_proj, GPT-2's c_attn), routers and "
            "fused MoE experts left out (on a mixture of experts, also every layer of a name peft takes as the "
            "experts': gate_proj, up_proj, down_proj, w1, w2, w3, so DeepSeek-V3's dense and shared MLPs). With a "
            "local model, validate says what will be adapted and refuses targets that adapt no layer of it, or "
            "that peft would turn into the experts' without target_experts."
        ),
    )
    target_experts: bool = Field(
        False,
        description=(
            "On a mixture of experts, adapt the routed experts too: an adapter on each MoE layer's fused expert "
            "weights (peft's target_parameters), beside target_modules; dropout is then 0. Off: no expert weight "
            "is adapted. Refused on a model without experts."
        ),
    )

    @model_validator(mode="after")
    def _experts_without_dropout(self) -> LoraSpec:
        if not self.target_experts:
            return self
        if "dropout" not in self.model_fields_set:
            self.dropout = 0.0
        elif self.dropout:
            raise ValueError(
                f"dropout = {self.dropout} with target_experts: peft adapts the experts' fused weights only without "
                "dropout; set dropout = 0 or leave it unset"
            )
        return self

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, value: object) -> object:
        """One message naming the entry, instead of pydantic's one per member of the union."""
        if value is None:
            return None
        if isinstance(value, str):
            return _lora_pattern(value)
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            raise ValueError("give a list of module names (['q_proj', 'v_proj']), 'all-linear' or a regular expression")
        if not value:
            raise ValueError(
                "an empty list adapts nothing: name the layers, e.g. ['q_proj', 'v_proj'], or 'all-linear'"
            )
        for index, name in enumerate(value):
            if not name.strip() or any(c.isspace() for c in name):
                raise ValueError(f"entry {index} ({name!r}) is no module name: give one like 'q_proj'")
        return value


def _lora_pattern(pattern: str) -> str:
    """'all-linear' or a regular expression that compiles (peft matches it with re.fullmatch)."""
    if is_all_linear(pattern):
        return pattern
    if not pattern.strip():
        raise ValueError("an empty pattern adapts nothing: give 'all-linear', a regular expression or a list of names")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{pattern!r} is not a regular expression ({exc})") from None
    return pattern


class ModelSpec(SpecModel):
    """The model to fine-tune."""

    path: str = Field(description="Local Hugging Face model directory (relative to run.toml), or a hub id 'org/name'.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Parameter dtype; CPU runs use float32 regardless."
    )
    export_dtype: Literal["base", "as-trained", "float32", "bfloat16", "float16"] = Field(
        "base",
        description=(
            "The dtype `jobgen export` writes the weights in. 'base': the one the base model's config.json names "
            "(torch_dtype), what it was published in; where it names none, 'as-trained'. 'as-trained': the dtype "
            "the checkpoint holds them in (float32 after a CPU run, model.dtype on a GPU), so the export equals "
            "the checkpoint bit for bit. A narrower dtype than training's rounds every weight once."
        ),
    )
    export_quantization: Literal["none", "base"] = Field(
        "none",
        description=(
            "Whether `jobgen export` quantizes what the base model had quantized. 'none': every weight in "
            "export_dtype (gpt-oss's MXFP4 experts as they trained, dequantized). 'base': those weights "
            "quantized again as the base model's files held them (gpt-oss's experts as MXFP4 blocks and scales, "
            "with its quantization config), the layout vLLM and the hub's readers of the published model expect; "
            "each value is rounded to its block's FP4 step, so a fine-tune's smaller changes are lost. A base "
            "model without quantized weights exports the same either way."
        ),
    )
    gradient_checkpointing: bool = Field(False, description="Non-reentrant activation checkpointing.")
    activation_offloading: bool = Field(
        False,
        description=(
            "Move the tensors kept for backward (with gradient_checkpointing: each block's input) to pinned host "
            "memory during forward and back during backward, on a separate CUDA stream. Needs "
            "gradient_checkpointing = true. Trades GPU memory for host memory and PCIe traffic; a no-op on CPU."
        ),
    )
    lora: LoraSpec | None = Field(None, description="LoRA adapters; omit for full fine-tuning.")
    attention: Literal["auto", "sdpa", "flex_attention", "eager"] = Field(
        "auto",
        description=(
            "The attention kernel (transformers' attn_implementation). 'auto': 'flex_attention' on GPUs when "
            "data.packing is on, whose block mask skips the pairs of tokens of different examples (sdpa gets a "
            "dense block-diagonal mask of rows x rows, and no flash kernel with it); 'sdpa' otherwise, and "
            "always on CPU, where flex attention needs a compiler and was measured slower; each where the "
            "model's class supports it, else 'eager' (Gemma 2 has no SDPA). The trainer logs which and why."
        ),
    )

    @model_validator(mode="after")
    def _offloading_needs_checkpointing(self) -> ModelSpec:
        if self.activation_offloading and not self.gradient_checkpointing:
            raise ValueError(
                "model.activation_offloading = true needs model.gradient_checkpointing = true: without it every "
                "intermediate activation would cross PCIe twice per step"
            )
        return self
