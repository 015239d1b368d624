"""One description of a causal LM's parts, read from transformers' own class and config rather
than from class-name patterns: which modules are its decoder layers (the class's
``_no_split_modules``: GPTNeoXLayer and GPT2Block as well as LlamaDecoderLayer), which
attention kernels the class supports (Gemma 2 has no SDPA), whether the head shares the
embedding's weight, its experts, and the linear layers of its blocks (what LoRA adapts by
default, fused projections such as Phi-3's ``qkv_proj`` included, routers excluded).

FSDP wrapping, compiling and checkpointing the blocks, the attention kernel, the buffers a
sharded load recomputes and LoRA's default targets all read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from jobgen.model.lora_targets import EXPERT_NAMES, ROUTERS
from jobgen.model.traits import ModelTraits, expert_count, resolve_attention
from trainer.model.errors import ModelError


@dataclass(frozen=True)
class Architecture:
    """What the trainer needs to know of a model class, before or after it is built."""

    class_name: str
    model_type: str
    layer_classes: tuple[str, ...]  # the decoder layers' class names (_no_split_modules)
    supports_sdpa: bool
    supports_flex: bool
    tied_embeddings: bool  # the head is the embedding's weight (config.tie_word_embeddings)
    experts: int  # routed experts per MoE layer (0: a dense model)

    @classmethod
    def of_class(cls, model_class: type, config) -> Architecture:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        experts = expert_count(text.to_dict())
        layers = tuple(getattr(model_class, "_no_split_modules", None) or ())
        return cls(
            class_name=model_class.__name__,
            model_type=str(getattr(config, "model_type", "")),
            layer_classes=layers,
            supports_sdpa=bool(getattr(model_class, "_supports_sdpa", False)),
            supports_flex=bool(getattr(model_class, "_supports_flex_attn", False)),
            tied_embeddings=bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))),
            experts=experts,
        )

    @classmethod
    def of_config(cls, config) -> Architecture:
        """The architecture of the causal LM ``AutoModelForCausalLM`` builds for ``config``."""
        from transformers import AutoModelForCausalLM

        mapping = AutoModelForCausalLM._model_mapping
        try:
            model_class = mapping[type(config)]
        except KeyError:
            raise ModelError(
                f"transformers has no causal LM for model_type {getattr(config, 'model_type', '?')!r}"
            ) from None
        return cls.of_class(model_class, config)

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> Architecture:
        base = pretrained_model(model)
        return cls.of_class(type(base), base.config)

    def decoder_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The model's decoder layers, in order. Raises ModelError when the class names none
        (``_no_split_modules`` unset) or none is in the model."""
        wanted = set(self.layer_classes)
        layers = [m for m in model.modules() if type(m).__name__ in wanted]
        if not layers:
            raise ModelError(
                f"{self.class_name} names no decoder layer class (_no_split_modules = {list(self.layer_classes)}) "
                "that its modules have: jobgen cannot shard, compile or checkpoint it by block"
            )
        return layers

    def attention(self, choice: str, gpu: bool, packing: bool) -> tuple[str, str]:
        """``model.attention`` resolved, and why (jobgen.model.traits.resolve_attention, the plan's
        rule too), from what this class supports."""
        return resolve_attention(
            choice, gpu=gpu, packing=packing, sdpa=self.supports_sdpa, flex=self.supports_flex, name=self.class_name
        )

    def lora_targets(self, model: torch.nn.Module) -> list[str]:
        """LoRA's default targets: the last names of every linear layer inside the decoder
        layers (attention and MLP projections, fused ones included), routers left out: peft's
        "all-linear" without its output layer, as names, which the trainer logs. validate names
        the same from the safetensors (jobgen.model.lora_targets.default_targets). On a mixture of
        experts, no layer of a name peft takes as the experts' (EXPERT_NAMES)."""
        names = {
            name.rsplit(".", 1)[-1]
            for layer in self.decoder_layers(model)
            for name, module in layer.named_modules()
            if name and _is_linear(module)
        }
        return sorted(names - set(ROUTERS) - (set(EXPERT_NAMES) if self.experts else set()))

    def expert_parameters(self, model: torch.nn.Module) -> list[str]:
        """The routed experts' fused weights, as peft's ``target_parameters`` names them
        (``experts.gate_up_proj``, ``experts.down_proj``): the 3-D parameters of each MoE
        layer's experts (:func:`routed_experts`)."""
        found = {
            f"experts.{parameter}"
            for _name, module in routed_experts(model)
            for parameter, tensor in module.named_parameters(recurse=False)
            if tensor.ndim == 3
        }
        return sorted(found)


def routed_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each MoE layer's routed experts: a module named ``experts`` holding the
    layer's fused 3-D weights (``gate_up_proj``, ``down_proj``; not a Mamba layer's 3-D
    convolution), every parameter of it one row per expert (gpt-oss's biases too)."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        if any(p.ndim == 3 for p in module.parameters(recurse=False)):
            found.append((name, module))
    return found


def model_traits(config) -> ModelTraits:
    """What jobgen.model.parallelism's model refusals read, from the loaded config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelTraits.of_config(config.to_dict(), tied=bool(getattr(text, "tie_word_embeddings", False)))


def _is_linear(module: torch.nn.Module) -> bool:
    # GPT-2's Conv1D is a linear layer with its weight transposed; peft adapts it as one.
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def pretrained_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel inside ``model`` (itself, or under peft's wrappers)."""
    from transformers import PreTrainedModel

    for module in model.modules():  # the model itself first
        if isinstance(module, PreTrainedModel):
            return module
    raise ModelError(f"{type(model).__name__} holds no transformers model")


class CheckpointLayout:
    """How the names in a model's safetensors map to its parameters, as transformers' own
    conversion mapping says (``transformers.conversion_mapping``): a key renamed (GPT-NeoX's
    ``embed_out`` is ``lm_head``; Mixtral's ``block_sparse_moe`` is ``mlp``), or several
    checkpoint tensors merged into one parameter (per-expert MoE weights into the fused
    ``experts.gate_up_proj``)."""

    def __init__(self, model: torch.nn.Module):
        self.renamings: list = []
        self.converters: list = []
        try:
            base = pretrained_model(model)
        except ModelError:  # a bare module (a test's, a pipeline stage's parts): names as they are
            return
        self.prefix = getattr(base, "base_model_prefix", None)
        self.meta = base.state_dict()
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming
        except ImportError:  # a transformers without conversions renames nothing
            return
        for transform in get_model_conversion_mapping(base):
            if isinstance(transform, WeightConverter):
                self.converters.append(transform)
            elif isinstance(transform, WeightRenaming):
                self.renamings.append(transform)

    def resolve(self, checkpoint_keys: Iterable[str]) -> tuple[dict[str, str], dict[str, dict[str, object]]]:
        """One pass over the checkpoint's keys: in-memory name -> checkpoint key for each key the
        library renames (and does not merge), and for each in-memory name it builds by merging
        several checkpoint tensors (fused experts) those keys and the converter merging them
        (trainer.model.merged_experts reads them)."""
        renamed: dict[str, str] = {}
        merged: dict[str, dict[str, object]] = {}
        if not self.renamings and not self.converters:
            return renamed, merged
        from transformers.core_model_loading import rename_source_key

        by_pattern = {pattern: c for c in self.converters for pattern in c.source_patterns}
        for key in checkpoint_keys:
            name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.meta)
            if pattern is not None:
                merged.setdefault(name, {})[key] = by_pattern[pattern]
            elif name != key:
                renamed[name] = key
        return renamed, merged
