"""Context parallelism: each sequence of a micro-batch split across ``train.context_parallel`` ranks.

Why
    At a long ``max_length`` the activations of one sequence outgrow one device. With
    ``[train] context_parallel = N`` the N ranks of a context-parallel group read the *same*
    rows; each keeps ``1/N`` of every row's tokens through the whole model (embeddings, MLPs,
    norms, output layer and loss all work per token), so activations per rank drop by about N.
    Only attention needs the other tokens.

How attention sees the whole row (Llama 3's approach)
    Each rank attends its own queries to the keys and values of the *whole* row: K and V are
    all-gathered across the group (torch's ``cplib::flex_cp_allgather`` custom op, whose
    backward is a reduce-scatter of dK and dV, so each rank gets back the gradients that every
    other rank's queries sent to its keys). The mask is built from the *global* position ids:
    a key is visible when it is in the same document (a new document wherever the position ids
    do not count up by one, transformers' packed-sequence rule) and not after the query;
    padding is a document of its own, so no row of the mask is ever empty (an empty row gives
    NaN, and NaN times a zero gradient is still NaN). torch's own ``context_parallel()`` cannot
    do this: its SDPA path takes no mask (only ``is_causal``), so packed documents would see
    each other, and it has no CPU lowering.

Load balance
    Under a causal mask the last tokens attend to the most keys. Rows are padded to a multiple
    of ``2N`` (and of 16; the padding has ignored labels) and cut into ``2N`` chunks; rank ``r``
    holds chunks ``r`` and ``2N-1-r`` (head-tail), so every rank gets the same causal work.

Labels
    The next-token shift is done on the whole row *before* sharding: the label of a rank's last
    token is the first token of the next chunk, which lives on another rank. Local labels are
    therefore already shifted; :meth:`ContextParallel.loss_sum` does not shift again.

Memory
    Per rank: ``1/N`` of the activations, the gathered K/V of each layer (``O(L)``, kept for
    backward), and one additive mask of ``(L/N) x L`` per row in the attention's dtype, built
    once per micro-batch on first use and shared by every layer and by backward. Nothing
    ``O(L^2)`` over the whole row lives on one rank.

How transformers is told
    :func:`register` adds :data:`ATTENTION` to transformers' ``AttentionInterface``;
    :meth:`ContextParallel.install` switches the model to it. No mask function is registered on
    purpose: for an implementation missing from ``AttentionMaskInterface``,
    ``masking_utils.create_causal_mask`` (and the sliding-window variant) returns ``None`` at
    once (even when given a 2-D padding mask), so the model builds no ``L x L`` mask of its own
    and never tries to read packing from the permuted, sharded position ids. The attention
    function reads the layout from :meth:`ContextParallel.active` instead, which must stay open
    through backward too (activation checkpointing runs the attention forward again there, on
    CUDA in autograd's own thread: hence a module-level stack, not a thread-local).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.model_errors import ModelError
from trainer.packing import IGNORE_INDEX

ATTENTION = "jobgen_context_parallel"
KEY = "train.context_parallel"


class ContextParallelError(ModelError):
    """Context parallelism cannot run this model or batch; the message names ``train.context_parallel``.
    A ModelError: raised while the trainer is built (or on the first step), every retry would fail alike."""


# ---------------------------------------------------------------- layout


def document_ids(position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per token, which document of its row it belongs to; ``-1`` for padding.

    A new document starts wherever the position ids do not count up by one: the rule
    transformers applies to packed rows (``masking_utils.find_packed_sequence_indices``), so
    the mask here agrees with the one the model builds without context parallelism. Padding
    (``valid`` false) is one document of its own: padded queries then attend to padding only,
    which keeps every mask row non-empty and every real token away from them.
    """
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    return torch.where(valid, starts.long().cumsum(-1), torch.full_like(position_ids, -1))


def head_tail_indices(length: int, size: int, rank: int) -> torch.Tensor:
    """The token indices rank ``rank`` of ``size`` holds of a row of ``length`` (a multiple of 2*size).

    Chunks ``rank`` and ``2*size-1-rank`` of ``2*size``: the early chunk has little causal work,
    the late one much, so every rank's sum is the same.
    """
    chunk = length // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([head, tail])


@dataclass
class Layout:
    """What attention needs to know of one sharded micro-batch: the group to gather over and,
    per row, the global index and document of the local queries and of the gathered keys (in
    the order the all-gather concatenates them: rank 0's tokens, then rank 1's, ...).

    The ``O(L)`` vectors live on the host; the ``(L/N) x L`` mask is built from them on the
    attention's device the first time a layer asks and is kept until :meth:`ContextParallel.active`
    closes (one per sliding-window size, for models that have them).
    """

    group: dist.ProcessGroup | None
    query_index: torch.Tensor  # [local]
    key_index: torch.Tensor  # [padded length]
    query_docs: torch.Tensor  # [batch, local]
    key_docs: torch.Tensor  # [batch, padded length]
    documents: bool = True  # False only in the tests' negative control
    _masks: dict[tuple[int | None, torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, device: torch.device, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """``[batch, 1, local, length]``, additive in the queries' dtype: 0 where the query may
        attend to the key, -inf elsewhere.

        Additive, not boolean: SDPA turns a boolean mask into an additive one on every call and
        saves that copy for backward, one ``(L/N) x L`` tensor per layer; the same additive
        tensor given to every layer is saved once.
        """
        cached = self._masks.get((window, device, dtype))
        if cached is not None:
            return cached
        q_idx = self.query_index.to(device)[None, :, None]
        k_idx = self.key_index.to(device)[None, None, :]
        allowed = k_idx <= q_idx
        if window is not None:
            allowed = allowed & (q_idx - k_idx < window)  # transformers' sliding_window_overlay
        if self.documents:
            q_docs = self.query_docs.to(device)[:, :, None]
            allowed = allowed & (q_docs == self.key_docs.to(device)[:, None, :])
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        mask = mask.unsqueeze(1)
        self._masks[(window, device, dtype)] = mask
        return mask

    def release(self) -> None:
        self._masks.clear()


@dataclass
class LocalBatch:
    """This rank's share of a micro-batch: model inputs of ``L/N`` tokens per row, the labels
    already shifted (``labels[:, t]`` is the target of position ``t``), and the attention layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    layout: Layout

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, Any]:
        """The forward's keyword arguments. No ``attention_mask`` (the layout is the mask) and
        ``use_cache=False`` (a cache would make transformers size masks from it)."""
        return {
            "input_ids": self.input_ids.to(device),
            "position_ids": self.position_ids.to(device),
            "use_cache": False,
        }


# ---------------------------------------------------------------- attention

_ACTIVE: list[Layout] = []


def _gather(key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup | None):
    """K and V of the whole row along dim 2; backward reduce-scatters their gradients.

    torch's custom op when the backend can run the collectives on these tensors; gloo on CUDA
    tensors goes through host copies (:class:`_HostGather`), so that several ranks can share
    one GPU in the benchmark (NCCL refuses two ranks on one device).
    """
    if group is None or dist.get_world_size(group) == 1:
        return key, value
    if key.device.type != "cpu" and dist.get_backend(group) == "gloo":
        return _HostGather.apply(key, group), _HostGather.apply(value, group)
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather

    return flex_cp_allgather(key, value, 2, group.group_name)


class _HostGather(torch.autograd.Function):
    """All-gather along dim 2 through host memory, reduce-scatter of the gradient on the way back."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.device = group, tensor.device
        size = dist.get_world_size(group)
        local = tensor.detach().movedim(2, 0).contiguous().cpu()
        out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype)
        dist.all_gather_into_tensor(out, local, group=group)
        return out.movedim(0, 2).to(ctx.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        full = grad.movedim(2, 0).contiguous().cpu()
        out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=full.dtype)
        dist.reduce_scatter_tensor(out, full, group=ctx.group)
        return out.movedim(0, 2).to(ctx.device), None


def _refuse_unsupported(module: torch.nn.Module, attention_mask: Any, kwargs: Mapping[str, Any]) -> None:
    if not _ACTIVE:
        raise ContextParallelError(
            f"the model runs the {KEY} attention outside ContextParallel.active(): "
            "run forward and backward of a sharded batch inside it"
        )
    if attention_mask is not None:  # transformers 5 passes None for an unknown mask interface
        raise ContextParallelError(f"{KEY}: the model built an attention mask of its own; it would be ignored")
    if not getattr(module, "is_causal", True):
        raise ContextParallelError(f"{KEY} supports causal (decoder) attention only")
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ContextParallelError(f"{KEY} does not support attention with {name}; set {KEY} = 1")


def context_parallel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature (``[batch, heads, tokens, dim]`` in, ``[batch, tokens,
    heads, dim]`` out): the local queries against the gathered K/V under the document-causal mask.

    K/V are gathered with their own (fewer, under GQA) heads and repeated afterwards, which
    moves ``num_heads / num_key_value_heads`` times fewer bytes. SDPA with a mask runs on CPU
    (its flash kernel) and uses the memory-efficient kernel on CUDA (flash takes no mask).
    """
    _refuse_unsupported(module, attention_mask, kwargs)
    layout = _ACTIVE[-1]
    key, value = _gather(key, value, layout.group)
    if key.shape[2] != layout.key_index.numel() or query.shape[2] != layout.query_index.numel():
        raise ContextParallelError(
            f"{KEY}: attention got {query.shape[2]} queries and {key.shape[2]} keys, the active layout "
            f"{layout.query_index.numel()} and {layout.key_index.numel()}: is the batch the one shard() made?"
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    mask = layout.mask(query.device, query.dtype, sliding_window)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Adds :data:`ATTENTION` to transformers' attention functions (idempotent). No mask function:
    see the module docstring."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_parallel_attention)


# ---------------------------------------------------------------- the per-process object


class ContextParallel:
    """One process's place in its context-parallel group: shards batches, runs attention over the group.

    ``group`` holds the ranks that read the same rows (a device mesh's ``"cp"`` dimension);
    ``None`` or a group of one runs unsharded through the same code (for comparisons).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """Switches ``model`` (before FSDP/DDP wrapping) to the context-parallel attention.

        Refuses models whose attention does not go through transformers' AttentionInterface
        (the switch would silently keep the old attention, which sees a fraction of the row).
        """
        register()
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise ContextParallelError(f"{KEY} needs a transformers model, got {type(model).__name__}")
        if not getattr(config, "is_causal", True):
            raise ContextParallelError(f"{KEY} supports causal (decoder) models only")
        if getattr(config, "attn_logit_softcapping", None):
            raise ContextParallelError(f"{KEY} does not support attention logit soft-capping ({config.model_type})")
        model.set_attn_implementation(ATTENTION)
        if config._attn_implementation != ATTENTION:
            raise ContextParallelError(
                f"{type(model).__name__} cannot switch its attention implementation (it does not use "
                f"transformers' AttentionInterface), so it cannot run with {KEY} > 1"
            )
        return model

    def shard(self, batch: Mapping[str, torch.Tensor]) -> LocalBatch:
        """This rank's share of a collated micro-batch (:func:`trainer.packing.collate`'s keys).

        Rows are padded to a multiple of ``2N`` and of 16 (ignored labels, a padding document;
        16 keeps the mask's rows aligned for CUDA's memory-efficient kernel, which otherwise
        pads a copy of the mask on every call), labels shifted over the whole row, then every
        row's chunks ``rank`` and ``2N-1-rank`` kept. Every rank of the group must pass the
        same batch (the all-gathers would mix rows or hang otherwise).
        """
        ids, labels = batch["input_ids"], batch["labels"]
        rows, length = ids.shape
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length).expand(rows, length)  # what the model uses without them
        mask = batch.get("attention_mask")
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        docs = document_ids(positions, valid)
        multiple = math.lcm(2 * self.size, 16)
        padded = math.ceil(length / multiple) * multiple
        extra = padded - length
        if extra:
            ids = torch.cat([ids, ids[:, -1:].expand(rows, extra)], dim=1)
            positions = torch.cat([positions, torch.arange(extra).expand(rows, extra)], dim=1)
            shifted = F.pad(shifted, (0, extra), value=IGNORE_INDEX)
            docs = F.pad(docs, (0, extra), value=-1)
        mine = head_tail_indices(padded, self.size, self.rank)
        order = torch.cat([head_tail_indices(padded, self.size, r) for r in range(self.size)])
        layout = Layout(self.group, mine, order, docs[:, mine], docs[:, order])
        return LocalBatch(ids[:, mine], positions[:, mine], shifted[:, mine], layout)

    @contextlib.contextmanager
    def active(self, local: LocalBatch) -> Iterator[Layout]:
        """The layout attention uses while open: wrap forward *and* backward of the micro-batch."""
        _ACTIVE.append(local.layout)
        try:
            yield local.layout
        finally:
            _ACTIVE.remove(local.layout)
            local.layout.release()

    @staticmethod
    def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over this rank's target tokens (float32) and their count.

        ``labels`` are :attr:`LocalBatch.labels`, already shifted: no shift here. The group's
        sums add up to :func:`trainer.packing.token_loss_sum` of the whole rows.
        """
        flat = labels.reshape(-1).to(logits.device)
        total = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), flat, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total, (flat != IGNORE_INDEX).sum()
