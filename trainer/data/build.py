"""Training data: turn the rows of ``[data] path`` (read by :mod:`trainer.data.source`) into
token ids + labels.

Every format becomes a list of text *segments*, each with a loss role, which are
tokenized separately and concatenated (:mod:`trainer.data.formats` makes the segments):

- ``alpaca``: the Stanford Alpaca prompt (instruction, optional input) as prompt,
  ``output`` + eos as the target;
- ``chat``: ``messages`` rendered turn by turn with the tokenizer's chat template
  (ChatML when it has none); targets are each assistant turn's content and its
  end-of-turn token, never the role header or the other turns;
- ``template``: a Jinja template over the row; the text rendered from
  ``response_column`` (+ eos) is the target, the rest is prompt;
- ``text``: ``text_column`` + eos, all target.

``labels`` is ``-100`` where no loss is taken. The first token is never a target:
nothing predicts it in an unpacked sequence, and in a packed row it would be
"predicted" from the previous example. Examples longer than ``max_length`` are
cut (the head is kept) and counted; an example left without any target token is
dropped and counted. Nothing is silent: the counts are returned as
:class:`~trainer.data.stats.DataStats` and end up in the cache's ``stats.json``.

The preprocessing cache (:mod:`trainer.data.cache`) decides where this runs and
calls one function here, :func:`build_dataset`; this module never writes anywhere
except the directories it is given.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets

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
    template_variables,
)
from trainer.data.source import load_raw
from trainer.data.stats import DataStats

IGNORE_INDEX = -100

# Rows per datasets.map batch: one batched tokenizer call each, so the Rust
# tokenizer can use its threads. A module attribute so tests can shrink it.
MAP_BATCH_SIZE = 1000
# data.num_proc unset: one tokenizing process per this many rows, up to the CPUs of the job.
AUTO_ROWS_PER_PROCESS = 20_000


def tokenizer_processes(rows: int, requested: int | None, cpus: int | None = None) -> int:
    """How many processes tokenize ``rows`` rows: ``requested`` (data.num_proc), else the CPUs
    this process may run on (the job's, on this node); never more than one per batch of rows,
    and without a request never more than one per AUTO_ROWS_PER_PROCESS rows."""
    if requested is not None:
        return max(1, min(requested, rows // MAP_BATCH_SIZE))
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, min(cpus, rows // AUTO_ROWS_PER_PROCESS))


# --------------------------------------------------------------------------- formatting


def required_columns(spec: DataSpec) -> list[str]:
    if spec.format == "alpaca":
        return ["instruction", "output"]
    if spec.format == "chat":
        return ["messages"]
    if spec.format == "text":
        return [spec.text_column]
    return [spec.response_column, *sorted(template_variables(spec.template or "") - {spec.response_column})]


def check_columns(raw: datasets.Dataset, spec: DataSpec, source: str) -> None:
    missing = [c for c in required_columns(spec) if c not in raw.column_names]
    if missing:
        raise DataError(
            f"data.path: {source}: format '{spec.format}' needs column(s) {', '.join(repr(c) for c in missing)}; "
            f"the data has {', '.join(repr(c) for c in raw.column_names) or 'no columns'}"
        )


log = logging.getLogger("trainer.data.build")

# How often tokenization says how far it got: a large set takes minutes, and a job log
# that says nothing for that long looks hung.
PROGRESS_LOG_SECONDS = 30.0


class Encoder:
    """The ``datasets.map`` function: a batch of rows → input_ids, labels and bookkeeping columns.

    ``rows`` and ``processes``: the whole set's size and how many processes share it. The
    process with the first shard logs how far it got every PROGRESS_LOG_SECONDS (the shards
    are equal and go at the same pace): rows, rate and ETA."""

    def __init__(self, spec: DataSpec, tokenizer, source: str, *, rows: int = 0, processes: int = 1):
        self.rows, self.processes = rows, max(1, processes)
        self.shard_start: int | None = None
        self.done = 0
        self.started = self.logged = 0.0
        self.spec = spec
        self.tokenizer = tokenizer
        self.source = source
        self.prefix = special_prefix(tokenizer) if spec.format != "chat" else []  # chat templates add their own
        self.eos = tokenizer.eos_token_id
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

    def _progress(self, indices: Sequence[int]) -> None:
        now = time.monotonic()
        if self.shard_start is None:
            self.shard_start, self.started, self.logged = (indices[0] if len(indices) else 0), now, now
        self.done += len(indices)
        if self.shard_start != 0 or not self.rows or now - self.logged < PROGRESS_LOG_SECONDS:
            return
        self.logged = now
        shard = -(-self.rows // self.processes)
        rate = self.done / max(now - self.started, 1e-9)
        where = f"{self.done:,}/{shard:,} rows" + (
            f" of the first of {self.processes} shards" if self.processes > 1 else ""
        )
        log.info(
            "tokenizing: %s (%.0f%%), %.0f rows/s%s, ETA %ds",
            where,
            100 * self.done / shard,
            rate,
            " per process" if self.processes > 1 else "",
            max(0, shard - self.done) / max(rate, 1e-9),
        )

    def __call__(self, batch: dict[str, list[Any]], indices: Sequence[int]) -> dict[str, list[Any]]:
        self._progress(indices)
        columns = list(batch)
        per_row = [self.segments({c: batch[c][k] for c in columns}, index) for k, index in enumerate(indices)]
        # One tokenizer call for the whole batch: the Rust tokenizer parallelises it.
        texts = [text for segs in per_row for text, _ in segs if text]
        ids_iter = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        out: dict[str, list[Any]] = {
            k: [] for k in ("input_ids", "labels", "length", "targets", "full_length", "full_targets")
        }
        max_length = self.spec.max_length
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

    def _labels(self, piece: list[int], role: int) -> list[int]:
        if role == PROMPT:
            return [IGNORE_INDEX] * len(piece)
        if role == TARGET:
            return list(piece)
        for k, token in enumerate(piece):
            if token in self.special_ids:
                return piece[: k + 1] + [IGNORE_INDEX] * (len(piece) - k - 1)
        return list(piece)  # no special token: the template ends turns with plain text, learn all of it


FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "length": datasets.Value("int32"),
        "targets": datasets.Value("int32"),
        "full_length": datasets.Value("int32"),
        "full_targets": datasets.Value("int32"),
    }
)


def tokenize_dataset(
    raw: datasets.Dataset,
    spec: DataSpec,
    tokenizer,
    *,
    source: str,
    work_dir: str | Path | None = None,
    num_proc: int = 1,
) -> tuple[datasets.Dataset, DataStats]:
    """Tokenize ``raw`` per ``spec``; return the kept examples (input_ids, labels, length) and the counts.

    With ``work_dir`` the intermediate Arrow files go there (the caller's private
    staging directory); without it everything stays in memory. Never next to the
    source data, which may be shared or read-only.

    ``num_proc`` > 1 forks that many workers, each tokenizing a contiguous shard; the
    result is the same, row order included. A row's error in a worker reaches the
    caller as the same DataError.
    """
    # Before the columns: data without rows has no columns either, and "empty" is the real problem.
    if len(raw) == 0:
        raise DataError(f"data.path: {source} is empty (0 rows)")
    check_columns(raw, spec, source)
    work = Path(work_dir) if work_dir is not None else None
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    num_proc = max(1, min(num_proc, len(raw)))
    with _tokenizer_threads(off=num_proc > 1):
        encoded = raw.map(
            Encoder(spec, tokenizer, source, rows=len(raw), processes=num_proc),
            batched=True,
            batch_size=MAP_BATCH_SIZE,
            with_indices=True,
            remove_columns=raw.column_names,
            features=FEATURES,
            keep_in_memory=work is None,
            # With num_proc, datasets suffixes each worker's shard file; all stay in work_dir.
            cache_file_name=str(work / "encoded.arrow") if work is not None else None,
            # An explicit fingerprint: hashing the tokenizer for datasets' own cache is slow and useless here.
            new_fingerprint="jobgen-encoded",
            num_proc=num_proc if num_proc > 1 else None,
            desc=f"tokenizing ({spec.format})",
        )
    stats = _stats(encoded.data, len(encoded), spec.max_length)
    if stats.kept == 0 and not _any_positive(encoded.data.column("full_targets")):
        raise DataError(_nothing_to_learn(raw, spec, source, stats))
    if stats.kept == 0:
        raise DataError(
            f"{source}: no example has a target token within max_length={spec.max_length} "
            f"(are the prompts longer than that?): {stats.summary()}"
        )
    kept = encoded.filter(
        lambda targets: [t > 0 for t in targets],
        input_columns=["targets"],
        batched=True,
        keep_in_memory=work is None,
        cache_file_name=str(work / "kept.arrow") if work is not None else None,
        new_fingerprint="jobgen-kept",
    )
    return kept.remove_columns(["targets", "full_length", "full_targets"]), stats


def build_dataset(
    spec: DataSpec,
    tokenizer,
    *,
    raw_dir: str | Path,
    work_dir: str | Path,
    raw: datasets.Dataset | None = None,
) -> tuple[datasets.Dataset, DataStats]:
    """The tokenized examples of ``spec.path`` and their counts: what a cache entry is made of.

    ``raw``: the rows, when the caller had to load them already (a hub dataset, to fingerprint
    it); else they are read here, the ``datasets`` builders writing their Arrow files to
    ``raw_dir``. Tokenization's intermediate files go to ``work_dir``, with as many processes
    as :func:`tokenizer_processes` allows for data.num_proc.
    """
    if raw is None:
        raw = load_raw(spec.path, cache_dir=raw_dir)
    procs = tokenizer_processes(len(raw), spec.num_proc)
    log.info("tokenizing %d rows of %s with %d process(es)", len(raw), spec.path, procs)
    return tokenize_dataset(raw, spec, tokenizer, source=spec.path, work_dir=work_dir, num_proc=procs)


@contextlib.contextmanager
def _tokenizer_threads(*, off: bool) -> Iterator[None]:
    """With worker processes, each worker's fast tokenizer runs single-threaded: the processes
    already use the CPUs, and a Rust thread pool that existed before the fork would make the
    tokenizers library warn and turn itself off in every worker anyway."""
    if not off:
        yield
        return
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _any_positive(column) -> bool:
    import pyarrow.compute as pc

    return bool(pc.any(pc.greater(column, 0)).as_py())


def _nothing_to_learn(raw: datasets.Dataset, spec: DataSpec, source: str, stats: DataStats) -> str:
    """Why no row has a single target token even before truncation: never max_length's fault."""
    if spec.format == "chat":
        # Loss is taken on assistant turns only; ShareGPT-style roles ("gpt", "bot") are the usual cause.
        sample = raw.select(range(min(len(raw), 1000)))["messages"]
        roles = sorted(
            {
                m["role"]
                for messages in sample
                if isinstance(messages, list)
                for m in messages
                if isinstance(m, dict) and isinstance(m.get("role"), str)
            }
        )
        return (
            f'data.path: {source} (data.format = "chat"): no row has an assistant turn '
            f"(roles seen: {', '.join(roles) or 'none'}); the loss is taken on assistant turns only, so there "
            'is nothing to learn. Add the replies as role "assistant" (rename e.g. "gpt" or "bot")'
        )
    return (
        f'data.path: {source} (data.format = "{spec.format}"): no row has a single target token, '
        f"even before truncation to max_length={spec.max_length}: {stats.summary()}"
    )


def _stats(table, examples_in: int, max_length: int) -> DataStats:
    """Counts over the encoded Arrow table, without pulling the token lists into Python."""
    import pyarrow.compute as pc

    def count(mask) -> int:
        return int(pc.sum(pc.cast(mask, "int64")).as_py() or 0)

    def total(column: str, where) -> int:
        return int(pc.sum(table.column(column).filter(where)).as_py() or 0)

    if examples_in == 0:
        return DataStats(0, 0, 0, 0, 0, 0, 0)
    has_target = pc.greater(table.column("targets"), 0)
    kept = count(has_target)
    return DataStats(
        examples_in=examples_in,
        kept=kept,
        truncated=count(pc.greater(table.column("full_length"), max_length)),
        dropped=examples_in - kept,
        total_tokens=total("length", has_target),
        target_tokens=total("targets", has_target),
        longest=int(pc.max(table.column("full_length")).as_py()),
    )
