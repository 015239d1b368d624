"""Training data: the rows of ``[data] path`` (:mod:`trainer.data.rows`) turned into token ids
and labels (:class:`trainer.data.encoder.Encoder`), shard by shard (:mod:`trainer.data.prepare`),
and counted.

Every format (alpaca, chat, template, text: :mod:`trainer.data.formats`) becomes text segments
with a loss role. An example longer than ``max_length`` is cut (the head is kept) and counted;
an example left without any target token is dropped and counted. Nothing is silent: the counts
are returned as :class:`~trainer.data.stats.DataStats` and end up in the cache's ``stats.json``.
This module decides how many processes tokenize and how big a shard is (a function of the row
count alone), and what is wrong with data that gives nothing to learn.

The preprocessing cache (:mod:`trainer.data.cache`) decides where this runs and calls one
function here, :func:`build_dataset`; this module never writes anywhere except the directories
it is given.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from jobgen.spec.tables.data import DataSpec
from trainer.data.formats import DataError, template_variables
from trainer.data.prepare import ShardWork, finish_dataset, pending_shards, shard_totals, tokenize_shards
from trainer.data.rows import RowSource, open_rows
from trainer.data.stats import DataStats

if TYPE_CHECKING:
    import datasets

# Rows per shard (trainer.data.prepare), at most: module attributes so tests can shrink them.
SHARD_ROWS = 20_000
# A source is cut into about this many shards when that keeps them above MIN_SHARD_ROWS: the
# processes and nodes that share a small source then share it evenly too.
TARGET_SHARDS = 64
MIN_SHARD_ROWS = 1000


def shard_rows(rows: int) -> int:
    """Rows per shard of a source of ``rows`` rows: a function of the row count alone, so that
    every build of a source, on any number of processes or nodes, writes the same files."""
    return min(SHARD_ROWS, max(MIN_SHARD_ROWS, -(-rows // TARGET_SHARDS)))


# data.num_proc unset: one tokenizing process per this many rows, up to the CPUs of the job.
AUTO_ROWS_PER_PROCESS = 20_000


def tokenizer_processes(rows: int, requested: int | None, cpus: int | None = None) -> int:
    """How many processes tokenize ``rows`` rows: ``requested`` (data.num_proc), else the CPUs
    this process may run on (the job's, on this node); never more than one per batch of rows,
    and without a request never more than one per AUTO_ROWS_PER_PROCESS rows."""
    if requested is not None:
        return max(1, min(requested, -(-rows // shard_rows(rows))))
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
    if spec.format == "tokenized":
        return ["input_ids"]
    return [spec.response_column, *sorted(template_variables(spec.template or "") - {spec.response_column})]


def check_columns(source: RowSource, spec: DataSpec) -> None:
    """The format's columns are there (in a loaded dataset, or in the first rows of a file that is
    read row by row); DataError naming the source and what it has."""
    names = source.column_names()
    missing = [c for c in required_columns(spec) if c not in names]
    if missing:
        raise DataError(
            f"data.path: {source.path}: format '{spec.format}' needs column(s) {', '.join(repr(c) for c in missing)}; "
            f"the data has {', '.join(repr(c) for c in names) or 'no columns'}"
        )


log = logging.getLogger("trainer.data.build")


def build_dataset(
    spec: DataSpec,
    tokenizer,
    *,
    dataset_dir: str | Path,
    done_dir: str | Path,
    raw_dir: str | Path,
    raw: datasets.Dataset | None = None,
    share: tuple[int, int] | None = None,
    finish: bool = True,
) -> DataStats | None:
    """Tokenize ``spec.path`` into ``dataset_dir`` (:mod:`trainer.data.prepare`): the shards of
    it not done yet (with ``share`` = (index, count), only every count-th from index: a node's),
    with as many processes as :func:`tokenizer_processes` allows for data.num_proc; then, with
    ``finish`` and when every shard of the source is done, the dataset's records and its counts
    (else None).

    ``raw``: the rows, when the caller had to load them already (a hub dataset, to fingerprint
    it); a source ``datasets`` must convert is converted into ``raw_dir``.
    """
    source = open_rows(spec.path, cache_dir=raw_dir, loaded=raw)
    check_columns(source, spec)
    work = ShardWork(source, spec, tokenizer, str(dataset_dir), str(done_dir), shard_rows(source.rows))
    count = work.shards
    todo = list(range(count)) if share is None else list(range(share[0], count, share[1]))
    kept = len(todo) - len(pending_shards(work, todo))
    if share is not None:
        log.info("data: this node's share of %d shards: %s%s", count, _listed(todo), _kept(kept, len(todo)))
    elif 0 < kept < len(todo):  # a stopped build continued (a publish after the nodes finds every shard done)
        log.info("data: %d shards%s", count, _kept(kept, count))
    procs = tokenizer_processes(source.rows, spec.num_proc)
    tokenize_shards(work, todo, procs, f"{spec.path} ({spec.format})", share=share is not None)
    if not finish or pending_shards(work, range(count)):
        return None
    counts = shard_totals(Path(done_dir), count)
    stats = DataStats(
        examples_in=counts.examples_in,
        kept=counts.kept,
        truncated=counts.truncated,
        dropped=counts.examples_in - counts.kept,
        total_tokens=counts.total_tokens,
        target_tokens=counts.target_tokens,
        longest=counts.longest,
    )
    if stats.kept == 0 and counts.learnable == 0:
        raise DataError(_nothing_to_learn(source, spec, stats))
    if stats.kept == 0:
        raise DataError(
            f"{spec.path}: no example has a target token within max_length={spec.max_length} "
            f"(are the prompts longer than that?): {stats.summary()}"
        )
    finish_dataset(Path(dataset_dir), count)
    return stats


def tokenize_dataset(
    raw: datasets.Dataset,
    spec: DataSpec,
    tokenizer,
    *,
    source: str,
    work_dir: str | Path | None = None,
    num_proc: int = 1,
) -> tuple[datasets.Dataset, DataStats]:
    """Tokenize the rows ``raw`` as a cache entry would be (every shard, ``num_proc`` processes)
    and load the result with ``datasets``: for looking at what preparation makes of some rows.
    The files go to ``work_dir``, or stay in memory without it."""
    import datasets

    if len(raw) == 0:
        raise DataError(f"data.path: {source} is empty (0 rows)")
    with contextlib.ExitStack() as stack:
        work = Path(work_dir) if work_dir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        (work / "dataset").mkdir(parents=True, exist_ok=True)
        (work / "done").mkdir(exist_ok=True)
        spec = spec.model_copy(update={"path": source, "num_proc": num_proc})
        stats = build_dataset(
            spec, tokenizer, dataset_dir=work / "dataset", done_dir=work / "done", raw_dir=work / "raw", raw=raw
        )
        assert stats is not None  # every shard was asked for
        return datasets.load_from_disk(str(work / "dataset"), keep_in_memory=work_dir is None), stats


def _kept(kept: int, of: int) -> str:
    """What the log says of the shards an earlier, stopped preparation left done."""
    return f"; {kept} of {of} done before (an earlier attempt's): kept, not tokenized again" if kept else ""


def _listed(shards: list[int]) -> str:
    return ", ".join(map(str, shards[:8])) + (f" and {len(shards) - 8} more" if len(shards) > 8 else "")


def _nothing_to_learn(source: RowSource, spec: DataSpec, stats: DataStats) -> str:
    """Why no row has a single target token even before truncation: never max_length's fault."""
    if spec.format == "chat":
        # Loss is taken on assistant turns only; ShareGPT-style roles ("gpt", "bot") are the usual cause.
        sample = [row.get("messages") for row in source.head(1000)]
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
            f'data.path: {source.path} (data.format = "chat"): no row has an assistant turn '
            f"(roles seen: {', '.join(roles) or 'none'}); the loss is taken on assistant turns only, so there "
            'is nothing to learn. Add the replies as role "assistant" (rename e.g. "gpt" or "bot")'
        )
    return (
        f'data.path: {source.path} (data.format = "{spec.format}"): no row has a single target token, '
        f"even before truncation to max_length={spec.max_length}: {stats.summary()}"
    )
