"""``jobgen data``: a run's tokenized data, prepared before the job starts (the command group
is built when asked for: jobgen.cli.main's ``lazy`` table, the one module of jobgen that may
reach the trainer).

    jobgen data prepare run.toml [--procs N]

``prepare`` fills the data cache entry the run's trainer would build at its start
(trainer.data.cache: the same fingerprint, the same shards, published the same way) for
``[data] path`` (each of ``[[data.sources]]``) and ``[eval] path``, on this machine (a login node, or a CPU job), with
``--procs`` tokenizing processes. The job then finds the entry and reads it: its GPUs never
wait on tokenizing. Shards a stopped preparation finished are not tokenized again.
"""

from __future__ import annotations

import logging
import sys
import time

import click

from jobgen.cli.common import fail, load, need_extra


@click.group(name="data")
def data() -> None:
    """A run's tokenized data (docs/data.md)."""


@data.command(name="prepare")
@click.argument("spec_file", type=click.Path(dir_okay=False))
@click.option(
    "--procs",
    type=click.IntRange(min=1),
    help="tokenizing processes [default: data.num_proc, else this machine's CPUs, one per 20,000 rows]",
)
def prepare(spec_file: str, procs: int | None) -> None:
    """Tokenize SPEC_FILE's data into the data cache its run reads."""
    spec = load(spec_file)
    if spec.run.data is None or spec.run.model is None:
        fail(
            f"jobgen data prepare: {spec_file}: the run has no [data] and [model] to prepare "
            "(its program reads its own)",
            2,
        )
    need_extra("train", ("transformers", "datasets", "pyarrow"), "data prepare")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    from trainer.data.cache import cache_root, cache_sharing
    from trainer.data.collective import prepare_dataset
    from trainer.data.examples import DataCacheError
    from trainer.data.formats import DataError
    from trainer.model.prep import ModelError, load_tokenizer

    data_spec = spec.run.data if procs is None else spec.run.data.model_copy(update={"num_proc": procs})
    # (the key that names it, its one-source [data]): each source of a mixture is its own entry.
    sources = [(prefix, one) for prefix, _name, one in data_spec.source_specs()]
    if spec.run.eval is not None and spec.run.eval.path is not None:
        sources.append(("eval", data_spec.model_copy(update={"path": spec.run.eval.path})))
    try:
        tokenizer = load_tokenizer(spec.run.model.path)
        for prefix, source in sources:
            started = time.monotonic()
            try:
                _examples, stats, entry = prepare_dataset(
                    source,
                    tokenizer,
                    spec.run.model.path,
                    cache_root(spec),
                    rank=0,
                    share=lambda value: value,
                    sharing=cache_sharing(spec),
                )
            except DataError as exc:
                raise exc.for_source(prefix) from None
            click.echo(f"{prefix}.path: {entry} ({time.monotonic() - started:.0f} s): {stats.summary()}")
    except (DataError, DataCacheError, ModelError) as exc:
        fail(f"jobgen data prepare: {exc}", 2 if isinstance(exc, DataError) else 1)
