"""The layout of a context-parallel group's rows (trainer/parallel/context_parallel.py explains the
design): which tokens each rank keeps (head and tail chunks), their documents, and the masks
attention applies to them, dense for SDPA or a flex BlockMask; plus the per-process compiled
flex kernels. Torch only; no collective runs here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


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

    The ``O(L)`` vectors live on the host; the mask (SDPA's ``(L/N) x L`` tensor or flex's
    block mask) is built from them on the attention's device the first time a layer asks and is
    kept until :meth:`ContextParallel.active` closes (one per sliding-window size, for models
    that have them).
    """

    group: dist.ProcessGroup | None
    query_index: torch.Tensor  # [local]
    key_index: torch.Tensor  # [padded length]
    query_docs: torch.Tensor  # [batch, local]
    key_docs: torch.Tensor  # [batch, padded length]
    documents: bool = True  # False only in the tests' negative control
    _masks: dict[tuple[int | None, torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _block_masks: dict[tuple[int | None, torch.device], BlockMask] = field(default_factory=dict)

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

    def mask_mod(self, device: torch.device, window: int | None = None) -> Callable[..., torch.Tensor]:
        """flex's ``mask_mod(b, h, q, kv)`` of the same rule as :meth:`mask`, for local query
        index ``q`` (of ``L/N``) and gathered key index ``kv`` (of ``L``): both mapped to global
        positions through :attr:`query_index` and :attr:`key_index`, documents looked up per
        local token. Everything it reads is ``O(L)``."""
        q_pos, k_pos = self.query_index.to(device), self.key_index.to(device)
        q_docs, k_docs = self.query_docs.to(device), self.key_docs.to(device)
        documents = self.documents

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            query, key = q_pos[q], k_pos[kv]
            allowed = key <= query
            if window is not None:
                allowed = allowed & (query - key < window)  # transformers' sliding_window_overlay
            if documents:
                allowed = allowed & (q_docs[b, q] == k_docs[b, kv])
            return allowed

        return mask_mod

    def block_mask(self, device: torch.device, window: int | None = None) -> BlockMask:
        """flex's ``BlockMask`` of :meth:`mask_mod`: ``B`` rows, one for all heads, ``Q_LEN = L/N``,
        ``KV_LEN = L``. Compiled ``create_block_mask`` (fused: the mask is never materialized)
        except on CPU, where inductor cannot compile it (see the module docstring)."""
        cached = self._block_masks.get((window, device))
        if cached is not None:
            return cached
        build = create_block_mask if device.type == "cpu" else _compiled("create_block_mask")
        mask = build(
            self.mask_mod(device, window),
            B=self.query_docs.shape[0],
            H=None,
            Q_LEN=self.query_index.numel(),
            KV_LEN=self.key_index.numel(),
            device=device,
        )
        self._block_masks[(window, device)] = mask
        return mask

    def release(self) -> None:
        self._masks.clear()
        self._block_masks.clear()


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


# ---------------------------------------------------------------- compiled flex kernels

_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled(name: str) -> Callable[..., Any]:
    """torch.compile of flex's ``create_block_mask`` or ``flex_attention``, made once per process
    (dynamo's cache then serves every later shape; the first new shape makes it dynamic)."""
    if name not in _COMPILED:
        if name == "create_block_mask":
            # fullgraph: a graph break would run the rest eagerly and materialize the (L/N) x L mask
            _COMPILED[name] = torch.compile(create_block_mask, fullgraph=True)
        else:
            _COMPILED[name] = torch.compile(flex_attention)
    return _COMPILED[name]
