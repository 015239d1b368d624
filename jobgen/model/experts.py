"""A mixture of experts' shape, as ``jobgen plan`` sizes it without torch: how many experts a
MoE layer routes to and how many each token goes to, their intermediate size, the shared
experts beside them, how many layers are MoE layers and how many parameters their routed
experts hold (from config.json and the safetensors' names, or config.json alone), and the
tensors a MoE family's config.json implies (:func:`moe_config_tensors`: Mixtral, Qwen2/3-MoE and
gpt-oss), so that a model can be planned before it is downloaded.

    shape = MoeShape.of(config, tensors)   # None for a dense model
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobgen.model.traits import BLOCK_INDEX, expert_count, text_config

# The routed experts' tensors: per-expert (``experts.3.w1``) or fused (``experts.gate_up_proj``),
# or Granite's fused ``block_sparse_moe.input_linear`` / ``output_linear``.
_ROUTED = re.compile(r"\.experts\.|\.block_sparse_moe\.(?:input|output)_linear\.")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
SHARED_KEYS = ("shared_expert_intermediate_size", "shared_intermediate_size")


@dataclass(frozen=True)
class MoeShape:
    """What the memory plan reads of a mixture of experts."""

    experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    expert_intermediate: int  # one expert's intermediate size
    shared_intermediate: int  # the shared experts' intermediate size, together (0: none)
    moe_layers: int  # decoder layers with routed experts (DeepSeek's first are dense)
    routed_numel: int  # parameters of one MoE layer's routed experts, all of them

    @classmethod
    def of(cls, config: Mapping[str, Any], tensors: Sequence[Any], num_layers: int) -> MoeShape | None:
        """From config.json's object and the model's parameter tensors (``TensorInfo``: name,
        shape, numel); None for a dense model."""
        experts = expert_count(config)
        if not experts:
            return None
        text = text_config(config)
        top_k = next((int(text[key]) for key in TOP_K_KEYS if text.get(key)), 1)
        inter = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 0)
        shared = next((int(text[key]) for key in SHARED_KEYS if text.get(key)), 0)
        if not shared and text.get("n_shared_experts"):
            shared = int(text["n_shared_experts"]) * inter  # DeepSeek: n experts of the same size
        per_layer: dict[int, int] = {}
        for tensor in tensors:
            match = BLOCK_INDEX.search(tensor.name)
            if match and _ROUTED.search(tensor.name):
                per_layer[int(match[1])] = per_layer.get(int(match[1]), 0) + tensor.numel
        dense = int(text.get("first_k_dense_replace") or 0)
        layers = len(per_layer) or max(0, num_layers - dense)
        routed = max(per_layer.values(), default=0)
        return cls(experts, top_k, inter, shared, layers, routed)

    def local_routed_numel(self, expert_parallel: int) -> int:
        """One MoE layer's routed expert parameters a rank's FSDP unit gathers: E / ep of them."""
        return self.routed_numel // max(1, expert_parallel)


def moe_config_tensors(config: Mapping[str, Any], hidden: int, layers: int) -> dict[str, list[int]]:
    """The MLP tensors of each layer of a MoE family that config.json alone describes (names as
    the hub's files have them), to add to the attention and norms a Llama-like layer has;
    {} for another family."""
    kind = config.get("model_type")
    experts = expert_count(config)
    inter = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
    shapes: dict[str, list[int]] = {}
    for i in range(layers):
        mlp = f"model.layers.{i}.mlp."
        if kind == "mixtral":
            moe = f"model.layers.{i}.block_sparse_moe."
            shapes[moe + "gate.weight"] = [experts, hidden]
            for e in range(experts):
                names = {"w1": [inter, hidden], "w2": [hidden, inter], "w3": [inter, hidden]}
                shapes |= {f"{moe}experts.{e}.{w}.weight": shape for w, shape in names.items()}
        elif kind in ("qwen2_moe", "qwen3_moe"):
            shapes[mlp + "gate.weight"] = [experts, hidden]
            for e in range(experts):
                names = {"gate_proj": [inter, hidden], "up_proj": [inter, hidden], "down_proj": [hidden, inter]}
                shapes |= {f"{mlp}experts.{e}.{w}.weight": shape for w, shape in names.items()}
            shared = int(config.get("shared_expert_intermediate_size") or 0)
            if shared:
                shapes[mlp + "shared_expert_gate.weight"] = [1, hidden]
                names = {"gate_proj": [shared, hidden], "up_proj": [shared, hidden], "down_proj": [hidden, shared]}
                shapes |= {f"{mlp}shared_expert.{w}.weight": shape for w, shape in names.items()}
        elif kind == "gpt_oss":
            shapes |= {mlp + "router.weight": [experts, hidden], mlp + "router.bias": [experts]}
            shapes |= {
                mlp + "experts.gate_up_proj": [experts, hidden, 2 * inter],
                mlp + "experts.gate_up_proj_bias": [experts, 2 * inter],
                mlp + "experts.down_proj": [experts, inter, hidden],
                mlp + "experts.down_proj_bias": [experts, hidden],
            }
    return shapes
