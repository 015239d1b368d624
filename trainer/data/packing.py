"""Batches for the model: best-fit packing, collation, and the token-summed loss.

Rows
    A *row* is what one sequence of a micro-batch holds: with ``packing`` several
    examples packed best-fit into at most ``max_length`` tokens (:func:`pack`),
    without it one example. :func:`build_rows` gives the rows the sampler indexes
    (:class:`Rows`: two arrays, no Python object per row or example);
    :func:`collate` turns a micro-batch of rows into tensors.

How packed examples are kept apart
    A packed batch carries per-example ``position_ids`` that restart at 0 at every
    example and **no** ``attention_mask``. transformers 5 (``masking_utils.
    create_causal_mask``) then detects the packed layout from the position ids and
    builds a block-diagonal causal mask for ``sdpa`` (the default, also on CPU),
    ``eager`` and ``flex`` attention; ``flash_attention_2/3`` turn the same
    position ids into varlen ``cu_seqlens``. So one batch format works on CPU and
    GPU, and nothing ``O(L²)`` is built or moved here.

    transformers only does that detection when the forward gets neither an
    ``attention_mask`` (even an all-ones one) nor a KV cache. ``use_cache``
    defaults to ``config.use_cache`` (True for most models, in train mode too), and
    the forward then creates an empty cache, which silently turns the detection
    off: every token attends across example boundaries and the loss still goes
    down. Hence :func:`model_inputs`, which passes ``use_cache=False``; also set
    ``model.config.use_cache = False`` when loading a model for training.
    ``tests/unit/test_packing.py`` checks the equivalence with examples run one by one
    and that each of these traps is real.

    The first token of every packed example is never a target (its label is
    ``-100``): in a row it would be "predicted" from the previous example's last
    token, which an unpacked sequence never does.

Loss
    :func:`token_loss_sum` returns the summed next-token loss and the number of
    target tokens, so that the trainer can divide by the *global* target count
    (all ranks, all micro-steps) and weight every token equally.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from trainer.data.examples import Examples

IGNORE_INDEX = -100


class Rows:
    """The rows the sampler indexes, in two arrays rather than a Python list per row: row
    ``r`` holds the example indices ``members[offsets[r]:offsets[r + 1]]`` (ascending). Without
    packing, row ``r`` is example ``r`` and there are no arrays at all. A million packed
    examples cost 16 MB here, where lists of Python ints cost about ten times that."""

    def __init__(self, count: int, members: np.ndarray | None = None, offsets: np.ndarray | None = None):
        self.count, self.members, self.offsets = count, members, offsets

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, row: int) -> list[int]:
        if not 0 <= row < self.count:
            raise IndexError(f"row {row} of {self.count}")
        if self.members is None:
            return [int(row)]
        return self.members[self.offsets[row] : self.offsets[row + 1]].tolist()

    def tokens(self, lengths: np.ndarray) -> np.ndarray:
        """Each row's tokens, given every example's."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if self.members is None:
            return lengths
        return np.add.reduceat(lengths[self.members], self.offsets[:-1]) if self.count else lengths[:0]

    def as_lists(self) -> list[list[int]]:
        return [self[r] for r in range(self.count)]


def pack_rows(lengths: Sequence[int] | np.ndarray, max_length: int) -> Rows:
    """Best-fit decreasing: the examples of ``lengths`` grouped into rows of at most
    ``max_length`` tokens.

    Longest first, each into the open row with the least room that still fits it (a new row if
    none does). Ties break on the index, so the result depends on the lengths only; rows are
    numbered as they open, and within a row indices are ascending. Python holds the open rows'
    room only; the assignment is an array.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > max_length:
        i = int(np.argmax(lengths > max_length))
        raise ValueError(f"example {i} has {int(lengths[i])} tokens, more than max_length={max_length}; truncate first")
    if len(lengths) and int(lengths.min()) <= 0:
        raise ValueError(f"example {int(np.argmax(lengths <= 0))} is empty")
    order = np.lexsort((np.arange(len(lengths)), -lengths))
    row_of = np.empty(len(lengths), dtype=np.int64)
    # (room left, row number), kept sorted: bisect finds the tightest row that fits.
    room: list[tuple[int, int]] = []
    rows = 0
    for start in range(0, len(order), 1 << 16):  # a block of Python ints at a time
        block = order[start : start + (1 << 16)]
        placed = []
        for n in lengths[block].tolist():
            k = bisect.bisect_left(room, (n, -1))
            if k == len(room):
                left, row = max_length - n, rows
                rows += 1
            else:
                left, row = room.pop(k)
                left -= n
            placed.append(row)
            if left > 0:
                bisect.insort(room, (left, row))
        row_of[block] = placed
    members = np.argsort(row_of, kind="stable")  # grouped by row, ascending within each
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=rows), out=offsets[1:])
    return Rows(rows, members, offsets)


def pack(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """:func:`pack_rows` as lists: the example indices of each row."""
    return pack_rows(lengths, max_length).as_lists()


def build_rows(lengths: Sequence[int] | np.ndarray, max_length: int, packing: bool) -> Rows:
    """The rows the sampler indexes: packed groups of example indices, or one example per row."""
    if packing:
        return pack_rows(lengths, max_length)
    return Rows(len(lengths))


def fill_ratio(row_tokens: np.ndarray, max_length: int) -> float:
    """Fraction of the rows' ``max_length`` slots that hold real tokens (for the log), from
    each row's tokens (:meth:`Rows.tokens`)."""
    if not len(row_tokens):
        return 0.0
    return float(np.sum(row_tokens)) / (len(row_tokens) * max_length)


def fetch_rows(
    dataset: Examples, rows: Rows | Sequence[Sequence[int]], row_ids: Sequence[int]
) -> list[list[dict[str, Any]]]:
    """The examples of the given rows, read from the tokenized dataset in one batched access."""
    flat = [i for r in row_ids for i in rows[r]]
    data = dataset.take(flat, ("input_ids", "labels")) if flat else {"input_ids": [], "labels": []}
    examples = [{"input_ids": a, "labels": b} for a, b in zip(data["input_ids"], data["labels"])]
    out, k = [], 0
    for r in row_ids:
        out.append(examples[k : k + len(rows[r])])
        k += len(rows[r])
    return out


def collate(
    rows: Sequence[Sequence[Mapping[str, Sequence[int]]]], *, pad_token_id: int, packing: bool
) -> dict[str, torch.Tensor]:
    """A micro-batch of rows (each a list of examples with ``input_ids`` and ``labels``) as tensors.

    Sequences are right-padded to the longest row of this batch, not to
    ``max_length``. Returns int64 tensors of shape ``[batch, longest]``:

    - packing: ``input_ids``, ``position_ids`` (restart at 0 per example; the
      padding tail counts from 0 as its own segment), ``labels``. No
      ``attention_mask``, on purpose (see the module docstring): never add one.
    - no packing (one example per row): ``input_ids``, ``attention_mask``
      (1 real, 0 padding), ``labels``.

    ``labels`` is ``-100`` on padding and on the first token of every example.
    Call the model as ``model(**model_inputs(batch))`` (everything but
    ``labels``, plus ``use_cache=False``, which packing needs), then
    :func:`token_loss_sum` with ``batch["labels"]``.
    """
    if not rows:
        raise ValueError("collate needs at least one row")
    ids_rows, label_rows, pos_rows = [], [], []
    for row in rows:
        if not row:
            raise ValueError("collate got an empty row")
        if not packing and len(row) != 1:
            raise ValueError(f"without packing a row holds one example, got {len(row)}")
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for example in row:
            ex_ids, ex_labels = list(example["input_ids"]), list(example["labels"])
            if len(ex_ids) != len(ex_labels) or not ex_ids:
                raise ValueError("an example needs non-empty input_ids and labels of equal length")
            ex_labels[0] = IGNORE_INDEX
            ids += ex_ids
            labels += ex_labels
            positions += range(len(ex_ids))
        ids_rows.append(ids)
        label_rows.append(labels)
        pos_rows.append(positions)

    longest = max(len(r) for r in ids_rows)
    batch = len(rows)
    input_ids = torch.full((batch, longest), pad_token_id, dtype=torch.long)
    labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.long)
    # What keeps the examples apart: position ids when packing, the attention mask otherwise.
    positions_or_mask = torch.zeros((batch, longest), dtype=torch.long)
    for b, (ids, row_labels, positions) in enumerate(zip(ids_rows, label_rows, pos_rows)):
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        labels[b, :n] = torch.tensor(row_labels, dtype=torch.long)
        if packing:
            positions_or_mask[b, :n] = torch.tensor(positions, dtype=torch.long)
            positions_or_mask[b, n:] = torch.arange(longest - n)
        else:
            positions_or_mask[b, :n] = 1
    if packing:
        return {"input_ids": input_ids, "position_ids": positions_or_mask, "labels": labels}
    return {"input_ids": input_ids, "attention_mask": positions_or_mask, "labels": labels}


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The forward's keyword arguments: the batch without ``labels``, plus ``use_cache=False``.

    Without ``use_cache=False`` the model builds a KV cache, and transformers then
    ignores the packed ``position_ids`` when building the attention mask (see the
    module docstring). Harmless for unpacked batches, so always call the model
    as ``model(**model_inputs(batch))``.
    """
    inputs: dict[str, Any] = {k: v for k, v in batch.items() if k != "labels"}
    inputs["use_cache"] = False
    return inputs


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Target tokens in a batch: labels that a next-token prediction is scored against."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over target tokens, and their count.

    ``logits[:, t]`` predicts ``labels[:, t + 1]``; the shift happens here. The
    loss is computed in float32 whatever the logits' dtype (bf16 log-softmax over
    a large vocabulary loses too much). Divide the sum by the global count.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    total = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total, (shift_labels != IGNORE_INDEX).sum()
