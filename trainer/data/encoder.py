"""Rows to token ids and labels: :class:`Encoder`, which formats a batch of rows
(:mod:`trainer.data.formats`), tokenizes it in one call and masks what carries no loss.

Every format becomes a list of text *segments*, each with a loss role, tokenized separately and
concatenated. ``labels`` is ``-100`` where no loss is taken. The first token is never a target:
nothing predicts it in an unpacked sequence, and in a packed row it would be "predicted" from
the previous example. Examples longer than ``max_length`` are cut (the head is kept); the
bookkeeping columns (targets, and length and targets before truncation) let the caller count
what was cut and what had nothing to learn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobgen.spec.tables.data import DataSpec
from trainer.data.formats import (
    PROMPT,
    TARGET,
    DataError,
    alpaca_segments,
    chat_renderer,
    chat_segments,
    jinja_env,
    row_text,
    special_prefix,
    template_segments,
)

IGNORE_INDEX = -100


class Encoder:
    """A batch of rows (as columns) → input_ids, labels and the bookkeeping columns that
    :mod:`trainer.data.prepare` counts: targets, and length and targets before truncation."""

    def __init__(self, spec: DataSpec, tokenizer, source: str):
        self.spec = spec
        self.tokenizer = tokenizer
        self.source = source
        # Chat templates add their own; pre-tokenized rows are taken as they are.
        self.prefix = special_prefix(tokenizer) if spec.format not in ("chat", "tokenized") else []
        self.vocab = len(tokenizer)
        self.eos = tokenizer.eos_token_id if spec.format != "tokenized" else None
        self.special_ids = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }
        self.compiled = jinja_env().from_string(spec.template) if spec.format == "template" else None
        self.render = chat_renderer(tokenizer) if spec.format == "chat" else None

    def segments(self, row: dict[str, Any], index: int) -> list[tuple[str, int]]:
        where = f"data.path: {self.source}: row {index}"  # every row error names the key and file
        fmt = self.spec.format
        if fmt == "alpaca":
            return alpaca_segments(row, where)
        if fmt == "template":
            return template_segments(row, self.spec, self.compiled, where)
        if fmt == "chat":
            return chat_segments(row.get("messages"), self.render, where)
        return [(row_text(row, self.spec.text_column, where), TARGET)]

    def __call__(self, batch: dict[str, list[Any]], indices: Sequence[int]) -> dict[str, list[Any]]:
        columns = list(batch)
        rows = [{c: batch[c][k] for c in columns} for k in range(len(indices))]
        encoded = self._given(rows, indices) if self.spec.format == "tokenized" else self._tokenized(rows, indices)
        out: dict[str, list[Any]] = {
            k: [] for k in ("input_ids", "labels", "length", "targets", "full_length", "full_targets")
        }
        max_length = self.spec.max_length
        for ids, labels in encoded:
            if labels:
                labels[0] = IGNORE_INDEX
            full_length = len(ids)
            # Before truncation: tells "nothing to learn in the row" from "cut off by max_length".
            full_targets = sum(1 for label in labels if label != IGNORE_INDEX)
            ids, labels = ids[:max_length], labels[:max_length]
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["length"].append(len(ids))
            out["targets"].append(sum(1 for label in labels if label != IGNORE_INDEX))
            out["full_length"].append(full_length)
            out["full_targets"].append(full_targets)
        return out

    def _tokenized(self, rows: list[dict[str, Any]], indices: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        """Text rows: formatted into segments, tokenized, the labels from the segments' roles."""
        per_row = [self.segments(row, index) for row, index in zip(rows, indices)]
        # One tokenizer call for the whole batch: the Rust tokenizer parallelises it.
        texts = [text for segs in per_row for text, _ in segs if text]
        ids_iter = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        encoded = []
        for segs in per_row:
            ids, labels = list(self.prefix), [IGNORE_INDEX] * len(self.prefix)
            for text, role in segs:
                if not text:
                    continue
                piece = list(next(ids_iter))
                ids += piece
                labels += self._labels(piece, role)
            if self.eos is not None and self.spec.format != "chat":
                ids.append(self.eos)
                labels.append(self.eos)
            encoded.append((ids, labels))
        return encoded

    def _given(self, rows: list[dict[str, Any]], indices: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        """Pre-tokenized rows (format "tokenized"): ``input_ids`` as they are, ``labels`` as
        given (-100 where no loss is taken), else every token a target."""
        encoded = []
        for row, index in zip(rows, indices):
            where = f"data.path: {self.source}: row {index}"
            ids = token_ids(row.get("input_ids"), f"{where}: input_ids", self.vocab)
            if row.get("labels") is None:
                labels = list(ids)
            else:
                labels = token_ids(row["labels"], f"{where}: labels", self.vocab, ignored=IGNORE_INDEX)
                if len(labels) != len(ids):
                    raise DataError(f"{where}: labels has {len(labels)} tokens, input_ids {len(ids)}")
            encoded.append((ids, labels))
        return encoded

    def _labels(self, piece: list[int], role: int) -> list[int]:
        if role == PROMPT:
            return [IGNORE_INDEX] * len(piece)
        if role == TARGET:
            return list(piece)
        for k, token in enumerate(piece):
            if token in self.special_ids:
                return piece[: k + 1] + [IGNORE_INDEX] * (len(piece) - k - 1)
        return list(piece)  # no special token: the template ends turns with plain text, learn all of it


def token_ids(value: Any, where: str, vocab: int, *, ignored: int | None = None) -> list[int]:
    """A pre-tokenized row's list of token ids, each within the vocabulary (or ``ignored``);
    DataError naming the row and the column otherwise."""
    if not isinstance(value, (list, tuple)) or not value:
        kind = "missing (null)" if value is None else f"a {type(value).__name__}" if value != [] else "empty"
        raise DataError(f"{where} is {kind}, not a non-empty list of token ids")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or not (0 <= token < vocab or token == ignored):
            raise DataError(f"{where}: {token!r} is not a token id of the tokenizer (0 to {vocab - 1})")
    return list(value)
