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
    other rank's queries sent to its keys). The mask follows the *global* position of each
    token: a key is visible when it is in the same document (a new document wherever the
    position ids do not count up by one, transformers' packed-sequence rule) and not after the
    query; padding is a document of its own, so no row of the mask is ever empty (an empty row
    gives NaN, and NaN times a zero gradient is still NaN). torch's own ``context_parallel()``
    cannot do this with SDPA: that path takes no mask (only ``is_causal``), so packed documents
    would see each other, and it has no CPU lowering.

Two kernels, one rule
    - flex_attention (:data:`FLEX_ATTENTION`), when the model's attention resolves to
      ``flex_attention`` (:func:`trainer.model.prep.attention_implementation`: a GPU and packed
      rows, by default) or ``ContextParallel(group, attention="flex_attention")`` /
      ``install(model, attention="flex_attention")`` asks for it. One ``BlockMask`` per sharded
      micro-batch (``Q_LEN = L/N`` local queries, ``KV_LEN = L`` gathered keys), built on first
      use by torch's compiled ``create_block_mask`` from a ``mask_mod`` that maps the local
      query index and the gathered key index to global positions through the load balancer's
      index tables (as torch's ``_create_cp_block_mask`` does), document ids per token from the
      global position ids; shared by every layer and by backward. torch's compiled
      ``flex_attention`` (as transformers' flex integration compiles it; the plain one inside a
      graph torch.compile is already tracing), GQA through ``enable_gqa``.
    - SDPA (:data:`ATTENTION`), otherwise (CPU, ``attention = "sdpa"``, unpacked rows): one
      additive ``(L/N) x L`` mask per row from the same rule.

What runs where, and why flex on GPUs
    Measured on an H100 (``bench/context_parallel_memory.py --device cuda --max-length 32768``,
    one packed row, a tiny 4-layer Llama, bf16 autocast, allocated peak per rank): CP=1 with
    the model's sdpa 11208 MiB; the SDPA path on 1 rank 15032, CP=2 7631, CP=4 3930; but CP=1
    with the model's flex_attention 2681 MiB. The dense ``(L/N) x L`` mask made context
    parallelism worse than flex without it, so on GPUs (packed rows) the flex path runs, which
    holds nothing ``O(L^2)``: the mask_mod's index and document vectors are ``O(L)`` and the
    block tables ``O((L/128)^2 / N)`` integers.
    On CPU training runs the SDPA path: torch 2.13's flex_attention has no backward there
    (``NotImplementedError: FlexAttention does not support backward on CPU``, re-raised as
    :class:`ContextParallelError`). Forward-only flex on CPU (the tests' check of the block
    mask) works, through torch's eager flex_attention (an unfused reference that materializes
    the scores) and an eager ``create_block_mask`` (the compiled one does not build on CPU:
    inductor's C++ code for this mask_mod fails to compile, "operands to '?:' have different
    types VecMask<int,1> and VecMask<float,1>"): ``O(L^2 / N)`` there, on CPU only.

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
    backward), and the micro-batch's mask, built on first use and shared by every layer and by
    backward: flex's block mask, or SDPA's additive ``(L/N) x L`` per row in the attention's
    dtype. Nothing ``O(L^2)`` over the whole row lives on one rank.

How transformers is told
    :func:`register` adds :data:`ATTENTION` and :data:`FLEX_ATTENTION` to transformers'
    ``AttentionInterface``; :meth:`ContextParallel.install` switches the model to one of them.
    No mask function is registered on purpose: for an implementation missing from
    ``AttentionMaskInterface``, ``masking_utils.create_causal_mask`` (and the sliding-window
    variant) returns ``None`` at once (even when given a 2-D padding mask), so the model builds
    no ``L x L`` mask (or block mask) of its own and never tries to read packing from the
    permuted, sharded position ids (the names contain neither "flex_attention" nor "sdpa", so
    transformers runs no dispatch checks of its own on them either). The attention functions
    read the layout from :meth:`ContextParallel.active` instead, which must stay open through
    backward too (activation checkpointing runs the attention forward again there, on CUDA in
    autograd's own thread: hence a module-level stack, not a thread-local). Looking the layout
    and its mask up is kept out of torch.compile (``torch.compiler.disable``), so compiled
    decoder blocks reuse the micro-batch's mask.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from trainer.data.packing import IGNORE_INDEX
from trainer.model.errors import ModelError
from trainer.parallel.context_parallel_layout import (
    Layout,
    LocalBatch,
    _compiled,
    document_ids,
    head_tail_indices,
)

ATTENTION = "jobgen_context_parallel"  # the SDPA path
FLEX_ATTENTION = "jobgen_context_parallel_flex"  # the flex_attention path
KERNELS = {"sdpa": ATTENTION, "flex_attention": FLEX_ATTENTION}  # what ``attention=`` accepts
KEY = "train.context_parallel"


class ContextParallelError(ModelError):
    """Context parallelism cannot run this model or batch; the message names ``train.context_parallel``.
    A ModelError: raised while the trainer is built (or on the first step), every retry would fail alike."""


# ---------------------------------------------------------------- layout


# The layouts open in ContextParallel.active(): a module-level stack, not a thread-local
# (checkpointed attention runs again in backward, on CUDA in autograd's own thread).
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


@torch.compiler.disable
def _layout_mask(kind: str, device: torch.device, dtype: torch.dtype, window: int | None) -> tuple[Layout, Any]:
    """The active layout and its mask for ``kind`` ("sdpa" or "flex_attention"), outside any
    torch.compile trace: built once per micro-batch, then the cached one."""
    layout = _ACTIVE[-1]
    if kind == "flex_attention":
        return layout, layout.block_mask(device, window)
    return layout, layout.mask(device, dtype, window)


def _check_shapes(layout: Layout, query: torch.Tensor, key: torch.Tensor) -> None:
    if key.shape[2] != layout.key_index.numel() or query.shape[2] != layout.query_index.numel():
        raise ContextParallelError(
            f"{KEY}: attention got {query.shape[2]} queries and {key.shape[2]} keys, the active layout "
            f"{layout.query_index.numel()} and {layout.key_index.numel()}: is the batch the one shard() made?"
        )


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
    layout, mask = _layout_mask("sdpa", query.device, query.dtype, sliding_window)
    key, value = _gather(key, value, layout.group)
    _check_shapes(layout, query, key)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def context_parallel_flex_attention(
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
    """:func:`context_parallel_attention` through flex_attention: the local queries against the
    gathered K/V under the micro-batch's :meth:`Layout.block_mask`.

    GQA stays GQA (``enable_gqa``; K/V repeated only for a query head count that is not a power
    of two, as transformers' flex integration does). No dropout (flex has none).
    """
    _refuse_unsupported(module, attention_mask, kwargs)
    if dropout:
        raise ContextParallelError(f"{KEY} with flex_attention has no attention dropout; set it to 0 or use sdpa")
    layout, block_mask = _layout_mask("flex_attention", query.device, query.dtype, sliding_window)
    key, value = _gather(key, value, layout.group)
    _check_shapes(layout, query, key)
    heads = query.shape[1]
    gqa = heads != key.shape[1]
    if gqa and heads & (heads - 1):
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
        gqa = False
    compiled = query.device.type != "cpu" and not torch.compiler.is_compiling()
    kernel = _compiled("flex_attention") if compiled else flex_attention
    try:
        out = kernel(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    except NotImplementedError as error:  # torch 2.13: no backward on CPU
        raise ContextParallelError(
            f"{KEY} with flex_attention on {query.device.type}: {error} (use attention sdpa there)"
        ) from error
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Adds :data:`ATTENTION` and :data:`FLEX_ATTENTION` to transformers' attention functions
    (idempotent). No mask function: see the module docstring."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_parallel_attention)
    AttentionInterface.register(FLEX_ATTENTION, context_parallel_flex_attention)


def flex_backward_error(device: torch.device | str) -> str | None:
    """Why flex_attention cannot train on ``device`` (torch's own error, from a tiny forward and
    backward), or ``None`` when it can. For scripts that want to refuse before they start."""
    q, k, v = (torch.zeros(1, 1, 16, 16, device=device, requires_grad=True) for _ in range(3))
    try:
        flex_attention(q, k, v).sum().backward()
    except NotImplementedError as error:
        return f"flex_attention on {torch.device(device).type} in torch {torch.__version__}: {error}"
    return None


# ---------------------------------------------------------------- the per-process object


def _kernel(attention: str) -> str:
    if attention not in KERNELS:
        raise ContextParallelError(f"{KEY} runs its attention with one of {sorted(KERNELS)}, not {attention!r}")
    return attention


class ContextParallel:
    """One process's place in its context-parallel group: shards batches, runs attention over the group.

    ``group`` holds the ranks that read the same rows (a device mesh's ``"cp"`` dimension);
    ``None`` or a group of one runs unsharded through the same code (for comparisons).
    ``attention`` ("sdpa" or "flex_attention", see :data:`KERNELS`) is the kernel
    :meth:`install` gives models; ``None``: the one each model's own attention resolves to.
    """

    def __init__(self, group: dist.ProcessGroup | None, attention: str | None = None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.attention = None if attention is None else _kernel(attention)

    def install(self, model: torch.nn.Module, attention: str | None = None) -> torch.nn.Module:
        """Switches ``model`` (before FSDP/DDP wrapping) to the context-parallel attention.

        The kernel: ``attention`` ("sdpa" or "flex_attention"), else the one given to the
        constructor, else the model's own: its flex_attention becomes the flex path, any other
        (sdpa, eager, ...) the SDPA path (the trainer sets the model's attention first,
        :func:`trainer.model.prep.prepare`). Refuses models whose attention does not go
        through transformers' AttentionInterface (the switch would silently keep the old
        attention, which sees a fraction of the row).
        """
        register()
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise ContextParallelError(f"{KEY} needs a transformers model, got {type(model).__name__}")
        if not getattr(config, "is_causal", True):
            raise ContextParallelError(f"{KEY} supports causal (decoder) models only")
        if getattr(config, "attn_logit_softcapping", None):
            raise ContextParallelError(f"{KEY} does not support attention logit soft-capping ({config.model_type})")
        kind = _kernel(attention) if attention is not None else self.attention
        if kind is None:
            own = getattr(config, "_attn_implementation", None)
            kind = "flex_attention" if own in ("flex_attention", FLEX_ATTENTION) else "sdpa"
        name = KERNELS[kind]
        model.set_attn_implementation(name)
        if config._attn_implementation != name:
            raise ContextParallelError(
                f"{type(model).__name__} cannot switch its attention implementation (it does not use "
                f"transformers' AttentionInterface), so it cannot run with {KEY} > 1"
            )
        return model

    def shard(self, batch: Mapping[str, torch.Tensor]) -> LocalBatch:
        """This rank's share of a collated micro-batch (:func:`trainer.data.packing.collate`'s keys).

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
        sums add up to :func:`trainer.data.packing.token_loss_sum` of the whole rows.
        """
        flat = labels.reshape(-1).to(logits.device)
        total = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), flat, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total, (flat != IGNORE_INDEX).sum()
