"""``jobgen data``: a run's tokenized data, prepared before the job starts (the command group
is built when asked for: jobgen.cli.main's ``lazy`` table, the one module of jobgen that may
reach the trainer).

    jobgen data prepare run.toml [--procs N] [--nodes N [--time 2h]]

``prepare`` fills the data cache entry the run's trainer would build at its start
(trainer.data.cache: the same fingerprint, the same shards, published the same way) for
``[data] path`` (each of ``[[data.sources]]``) and ``[eval] path``, on this machine (a login
node, or a CPU job), with ``--procs`` tokenizing processes. The job then finds the entry and
reads it: its GPUs never wait on tokenizing. Shards a stopped preparation finished are not
tokenized again.

With ``--nodes N`` it asks Slurm for a CPU job of N nodes (``srun`` in the foreground: one task
per node with the site's CPUs per node) whose nodes each tokenize a share of the shards, as a
multi-node run's nodes do; every node runs this module:

    python -m trainer.prepare_data run.toml [--procs N]     # as task SLURM_PROCID of SLURM_NTASKS
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from jobgen.base.durations import format_slurm, parse_duration
from jobgen.cli.common import fail, load, need_extra

if TYPE_CHECKING:  # `jobgen --help` imports this module: not pydantic with it
    from jobgen.spec.resolved import ResolvedSpec

# The nodes' rendezvous for --nodes: rank 0's node, this port plus the job id modulo 10,000.
NODE_PORT_BASE = 29600
# Tokenizing a large source can take hours while the other nodes wait in the collective.
NODE_TIMEOUT = dt.timedelta(hours=6)

log = logging.getLogger("trainer.prepare_data")


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
@click.option(
    "--nodes",
    type=click.IntRange(min=1, max=1024),
    help="prepare in a CPU job of this many nodes (srun), each tokenizing a share",
)
@click.option("--time", "time_limit", default="2h", show_default=True, help="the CPU job's time limit (with --nodes)")
def prepare(spec_file: str, procs: int | None, nodes: int | None, time_limit: str) -> None:
    """Tokenize SPEC_FILE's data into the data cache its run reads."""
    spec = load(spec_file)
    if spec.run.data is None or spec.run.model is None:
        fail(
            f"jobgen data prepare: {spec_file}: the run has no [data] and [model] to prepare "
            "(its program reads its own)",
            2,
        )
    if nodes is not None:
        _on_nodes(spec, spec_file, nodes, time_limit, procs)
        return
    need_extra("train", ("transformers", "datasets", "pyarrow"), "data prepare")
    _logging()
    _prepare(spec, procs, rank=0, share=lambda value: value, nodes=None)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)


def node_step(
    spec: ResolvedSpec, spec_file: str, nodes: int, seconds: int, procs: int | None
) -> tuple[list[str], list[str], dict[str, str]]:
    """(srun's options, the command of every node, the environment it adds) for ``--nodes``: a
    job of ``nodes`` nodes, one task each with the site's CPUs per node (no GPU), under the
    site's partition, account, QOS and constraint, for at most ``seconds``; a node that fails
    ends the others. The environment is the site's, as a batch script exports it: [env],
    HF_HOME, and Gloo on the site's interface (network.ifname), its network variables too."""
    slurm = spec.site.slurm
    options = [
        f"--job-name={spec.run.job.name}-data",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={slurm.cpus_per_node}",
        f"--time={format_slurm(seconds)}",
        "--kill-on-bad-exit=1",
    ]
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(slurm, key):
            options.append(f"--{key}={getattr(slurm, key)}")
    command = [sys.executable, "-m", "trainer.prepare_data", str(Path(spec_file).resolve())]
    site = spec.site
    env = {**site.env, **site.network.env}
    if site.paths.hf_home:
        env.setdefault("HF_HOME", site.paths.hf_home)
    if site.network.ifname:
        env["GLOO_SOCKET_IFNAME"] = site.network.ifname
    return options, command + (["--procs", str(procs)] if procs else []), env


def _on_nodes(spec: ResolvedSpec, spec_file: str, nodes: int, time_limit: str, procs: int | None) -> None:
    """``--nodes``: the CPU job, in the foreground; its exit status is this command's."""
    from jobgen.slurm import client as slurm

    if spec.site.python.kind == "container":
        fail(
            f"jobgen data prepare --nodes: site '{spec.site.name}' runs jobs in a container, which this "
            "job's step does not start: run `jobgen data prepare` in the image, or let the run prepare its data",
            2,
        )
    try:
        seconds = parse_duration(time_limit)
    except ValueError as exc:
        fail(f"jobgen data prepare: --time {time_limit!r}: {exc}", 2)
    options, command, env = node_step(spec, spec_file, nodes, seconds, procs)
    click.echo(f"jobgen data prepare: a CPU job of {nodes} node(s): srun {' '.join(options)}", err=True)
    try:
        code = slurm.run_job_step(options, command, env)
    except slurm.SlurmError as exc:
        fail(f"jobgen data prepare: {exc}", 1)
    if code:
        sys.exit(code)


def _prepare(spec: ResolvedSpec, procs: int | None, *, rank: int, share: Callable, nodes) -> None:
    """Every source of the run (and ``[eval] path``), found or built in the data cache; rank 0
    prints each entry. Exits 2 for bad data, 1 for a cache or model failure."""
    from trainer.data.cache import cache_root, cache_sharing
    from trainer.data.collective import prepare_dataset
    from trainer.data.examples import DataCacheError
    from trainer.data.formats import DataError
    from trainer.model.prep import ModelError, load_tokenizer

    assert spec.run.data is not None and spec.run.model is not None
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
                    rank=rank,
                    share=share,
                    sharing=cache_sharing(spec),
                    nodes=nodes,
                )
            except DataError as exc:
                raise exc.for_source(prefix) from None
            if rank == 0:
                click.echo(f"{prefix}.path: {entry} ({time.monotonic() - started:.0f} s): {stats.summary()}")
    except (DataError, DataCacheError, ModelError) as exc:
        code = 2 if isinstance(exc, DataError) else 1
        if rank == 0:
            fail(f"jobgen data prepare: {exc}", code)
        log.info("rank %d: %s", rank, exc)  # rank 0 says why, once
        sys.exit(code)


def on_this_node(spec_file: str, procs: int | None) -> None:
    """One node's part of ``--nodes``: task SLURM_PROCID of SLURM_NTASKS, in a gloo group whose
    rendezvous is the first node of the job; each node tokenizes its share, rank 0 publishes."""
    import torch.distributed as dist

    from jobgen.slurm import client as slurm
    from trainer.data.collective import Nodes

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    head = slurm.hostnames(os.environ["SLURM_JOB_NODELIST"])[0]
    port = NODE_PORT_BASE + int(os.environ["SLURM_JOB_ID"]) % 10_000
    _logging()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{head}:{port}", rank=rank, world_size=world, timeout=NODE_TIMEOUT
    )
    try:

        def share(value: object) -> object:
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        def gather(value: object) -> list:
            every: list = [None] * world
            dist.all_gather_object(every, value)
            return every

        spec = load(spec_file)
        # Every node read run.toml for itself: one that read another (edited meanwhile) stops.
        mine = hashlib.sha256(spec.run.model_dump_json().encode()).hexdigest()
        if gather(mine) != [mine] * world:
            fail(f"jobgen data prepare: {spec_file} changed while the nodes read it: run it again", 2)
        _prepare(spec, procs, rank=rank, share=share, nodes=Nodes(gather, first_on_node=True, name=Nodes.node_name()))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """``python -m trainer.prepare_data run.toml [--procs N]``, as ``--nodes`` starts it on each node."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trainer.prepare_data", description=on_this_node.__doc__)
    parser.add_argument("spec_file")
    parser.add_argument("--procs", type=int)
    args = parser.parse_args(argv)
    on_this_node(args.spec_file, args.procs)


if __name__ == "__main__":
    main()
