"""A causal LM's pieces as a pipeline stage runs them, found on the model itself rather than
by family, and one stage's forward through them.

    parts = ModelParts.of(full_model)            # PipelineError naming what a family lacks
    view = StageView(owner, parts, stage_index)  # what torch's PipelineStage runs

Every family the pipeline trains (jobgen.model.parallelism's PIPELINE_MODEL_TYPES) runs its base
model as the same steps, which transformers' base models do in their forward and a stage does
on its share of the blocks:

1. the input embedding (``get_input_embeddings``: Llama's ``embed_tokens``, GPT-NeoX's
   ``embed_in``, GPT-2's ``wte``; Gemma's scales itself), GPT-2's absolute positions
   (``wpe``) added, the embedding dropout (GPT-2's ``drop``, GPT-NeoX's ``emb_dropout``);
2. the attention masks, one per kind of layer (full, or sliding as the config's
   ``layer_types`` or ``sliding_window`` say), from the same transformers functions;
3. the rotary position embeddings (none for GPT-2; per kind of layer for Gemma 3);
4. the decoder blocks, each called as the base model calls it (a block returning a tuple
   gives its first element);
5. the final norm (``norm``, ``final_layer_norm``, ``ln_f``), the output layer
   (``get_output_embeddings``: ``lm_head``, GPT-NeoX's ``embed_out``) and the logits'
   soft-capping where the config asks for it (Gemma 2 and 3's ``final_logit_softcapping``).

The names a StageModule registers are the full model's (``transformer.h.3`` for GPT-2), so
checkpoints and the safetensors line up whatever the layout.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from trainer.model.errors import ModelError

NORM_NAMES = ("norm", "final_layer_norm", "ln_f")
LAYER_LIST_NAMES = ("layers", "h")
EMBEDDING_DROPOUT_NAMES = ("drop", "emb_dropout")


class PipelinePartsError(ModelError):
    """The model lacks a piece a stage runs; the message names it."""


def attention_kinds(config) -> list[str]:
    """Each decoder layer's attention, as the base model masks it: ``config.layer_types`` where
    the config has them (Qwen2, Qwen3, Gemma 2/3, gpt-oss: "full_attention" or
    "sliding_attention" per layer), else every layer sliding when ``sliding_window`` is set
    (Mistral), else every layer full (Llama)."""
    layers = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds[:layers])
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * layers


@dataclass(frozen=True)
class ModelParts:
    """Where a causal LM keeps each piece a stage runs: attribute names on its base model
    (``base``, its ``base_model_prefix``) and on the model (the head)."""

    base: str  # "model", "gpt_neox", "transformer"
    embed: str  # on the base
    layers: str  # on the base: the decoder blocks' ModuleList
    norm: str  # on the base
    head: str  # on the model
    rotary: str | None  # on the base; None: no rotary positions (GPT-2)
    positions: str | None  # on the base: absolute position embeddings (GPT-2's wpe)
    dropout: str | None  # on the base: the embedding dropout
    rotary_by_kind: bool  # the rotary embedding takes the layer's kind (Gemma 3)

    @classmethod
    def of(cls, full: nn.Module) -> ModelParts:
        prefix = getattr(full, "base_model_prefix", "model")
        base = getattr(full, prefix, None)
        embed, head = _embedding_name(base, full.get_input_embeddings()), _head_name(full)
        found = {
            "embed": embed,
            "layers": next((n for n in LAYER_LIST_NAMES if isinstance(getattr(base, n, None), nn.ModuleList)), None),
            "norm": next((n for n in NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)), None),
            "head": head,
        }
        missing = [what for what, name in found.items() if name is None]
        if base is None or missing:
            raise PipelinePartsError(
                f"model.path: {type(full).__name__} lacks {', '.join(missing) or prefix}: a pipeline stage needs an "
                "input embedding, a list of decoder blocks, a final norm and an output layer; train it without "
                "train.pipeline"
            )
        rotary = getattr(base, "rotary_emb", None)
        by_kind = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        return cls(
            base=prefix,
            rotary="rotary_emb" if rotary is not None else None,
            positions="wpe" if isinstance(getattr(base, "wpe", None), nn.Embedding) else None,
            dropout=next((n for n in EMBEDDING_DROPOUT_NAMES if isinstance(getattr(base, n, None), nn.Dropout)), None),
            rotary_by_kind=by_kind,
            **found,  # type: ignore[arg-type]
        )


def _embedding_name(base: nn.Module | None, embedding: nn.Module | None) -> str | None:
    if base is None or embedding is None:
        return None
    return next((name for name, child in base.named_children() if child is embedding), None)


def _head_name(full: nn.Module) -> str | None:
    head = full.get_output_embeddings()
    return next((name for name, child in full.named_children() if child is head), None) if head is not None else None


class StageView(nn.Module):
    """One stage of a StageModule: the modules it shares with it, and the stage's forward.
    torch's PipelineStage runs this; FSDP2 and replicate wrap it (one root per stage)."""

    def __init__(self, owner: nn.Module, parts: ModelParts, stage_index: int):
        super().__init__()
        self.config = owner.config
        self.parts = parts
        self.stage_index = stage_index
        first, last = stage_index == 0, stage_index == owner.num_stages - 1
        base = getattr(owner, parts.base)
        self.embed = getattr(base, parts.embed) if first else None
        self.positions = getattr(base, parts.positions) if first and parts.positions else None
        self.dropout = getattr(base, parts.dropout) if first and parts.dropout else None
        stage_layers = getattr(base, parts.layers)
        self.layers = nn.ModuleDict({str(i): stage_layers[str(i)] for i in owner.stage_ranges[stage_index]})
        self.norm = getattr(base, parts.norm) if last else None
        self.rotary = getattr(base, parts.rotary) if parts.rotary else None
        self.head = getattr(owner, parts.head) if last else None
        self.attention_kinds = attention_kinds(owner.config)
        self.softcap = getattr(owner.config, "final_logit_softcapping", None)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x``: token ids on the first stage, the previous stage's hidden states otherwise.
        Returns hidden states, or the logits on the last stage."""
        hidden = x if self.embed is None else self._embed(x, position_ids)
        kinds = {self.attention_kinds[int(index)] for index in self.layers}
        # Rebuilt on every stage from what every rank gets (kwargs are not sent between
        # stages): packed rows give a block-diagonal mask, plain causal sdpa none at all; a
        # sliding layer's mask also hides the tokens beyond its window, as the base model's is.
        masks = {kind: _mask(kind, self.config, hidden, attention_mask, position_ids) for kind in kinds}
        rotary = self._rotary(hidden, position_ids, kinds)
        for index, layer in self.layers.items():
            kind = self.attention_kinds[int(index)]
            extra = {"position_embeddings": rotary[kind]} if rotary else {}
            out = layer(hidden, attention_mask=masks[kind], position_ids=position_ids, **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.head is None:
            return hidden
        assert self.norm is not None
        logits = self.head(self.norm(hidden))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _embed(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None
        hidden = self.embed(ids)
        if self.positions is not None:
            hidden = hidden + self.positions(position_ids)
        return self.dropout(hidden) if self.dropout is not None else hidden

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]) -> dict[str, object]:
        if self.rotary is None:
            return {}
        if self.parts.rotary_by_kind:
            return {kind: self.rotary(hidden, position_ids, kind) for kind in kinds}
        shared = self.rotary(hidden, position_ids=position_ids)
        return dict.fromkeys(kinds, shared)


def _mask(kind: str, config, hidden: torch.Tensor, attention_mask, position_ids):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
    return make(
        config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None, position_ids=position_ids
    )
