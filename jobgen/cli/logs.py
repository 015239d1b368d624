"""``jobgen logs RUN|SWEEP``: one run's logs merged into one stream, or every point's of a
sweep, each line prefixed with its point (the command is built when asked for:
jobgen.cli.main's ``lazy`` table).

    jobgen logs RUN -f --rank 0
    jobgen logs RUN --all                 # every line, not only the last 1000
    jobgen logs lr-sweep --grep 'ERROR|time limit'
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import click

from jobgen.base.safe_read import DamagedFile
from jobgen.base.visible import visible
from jobgen.cli.common import fail, find_run
from jobgen.report.logs import Filters, Source, find_sources, merged, tail, unknown_ranks
from jobgen.report.logs import follow as follow_logs

# Ask Slurm at most this often, while following, whether anything is still queued or running.
CHECK_EVERY_S = 10.0


def _sweep_sources(directory: Path, filters: Filters) -> list[Source]:
    """Every point's sources, their task names prefixed with the point's."""
    from jobgen.runs.sweep_runs import point_runs

    out = []
    for entry, run in point_runs(directory):
        if run.exists():
            out += [replace(s, name=f"{entry.name} {s.name}") for s in find_sources(run, entry.name, filters)]
    return out


def _finished(is_over: Callable[[], bool]) -> Callable[[], bool]:
    last_check = [0.0]

    def finished() -> bool:
        if time.time() - last_check[0] < CHECK_EVERY_S:
            return False
        last_check[0] = time.time()
        return is_over()

    return finished


Sources = Callable[[Filters], list[Source]]


def _what_to_read(run_ref: str) -> tuple[Sources, Callable[[], bool]]:
    """Where RUN's (or SWEEP's) logs are, and whether nothing of it is queued or running."""
    from jobgen.cli.sweep import sweep_ref
    from jobgen.runs.sweep_runs import SweepError, read_sweep

    sweep = sweep_ref(run_ref)
    if sweep is not None:
        try:
            read_sweep(sweep)  # a sentence, not a traceback, for one that cannot be read
        except SweepError as exc:
            fail(f"jobgen: {exc}")

        def sweep_sources(filters: Filters) -> list[Source]:
            return _sweep_sources(sweep, filters)

        def sweep_over() -> bool:  # asked only while following: the status modules load then
            from jobgen.sweep.status import sweep_status

            return sweep_status(sweep)["state"] not in ("pending", "running", "unknown")

        return sweep_sources, sweep_over
    run = find_run(run_ref)
    try:
        name = run.load_spec().run.job.name
    except DamagedFile as exc:
        # The logs are still there: Slurm names them after the job, which is the directory's name.
        click.echo(f"jobgen logs: warning: {exc}; reading the logs of job name {visible(run.path.name)}", err=True)
        return lambda filters: find_sources(run, run.path.name, filters), lambda: True

    def run_sources(filters: Filters) -> list[Source]:
        return find_sources(run, name, filters)

    def run_over() -> bool:  # asked only while following: the status modules load then
        from jobgen.report.status import run_status

        return run_status(run, details=False).state not in ("pending", "running", "unknown")

    return run_sources, run_over


# Lines `jobgen logs` shows unless asked for more (--tail N, --all, --grep).
LOGS_TAIL = 1000


@click.command()
@click.argument("run_ref", metavar="RUN")
@click.option("-f", "--follow", is_flag=True, help="keep printing as the logs grow, until Ctrl-C or the run ends")
@click.option("--task", help="one task: its index in the array (3), Slurm's name (5_3) or its job id")
@click.option("--node", help="one node's lines")
@click.option("--rank", type=click.IntRange(0), help="one global rank's lines")
@click.option("--grep", "pattern", help="only lines matching this regular expression (every match, unless --tail)")
@click.option(
    "-n",
    "--tail",
    "last",
    type=click.IntRange(1),
    help=f"only the last N lines, read from the files' ends [default: {LOGS_TAIL}, every match with --grep]",
)
@click.option("--all", "every_line", is_flag=True, help="every line since the run began (reads the whole history)")
def logs(
    run_ref: str,
    follow: bool,
    task: str | None,
    node: str | None,
    rank: int | None,
    pattern: str | None,
    last: int | None,
    every_line: bool,
) -> None:
    """The run's logs merged into one stream: the batch logs and every rank's output, each
    line prefixed with its task (ARRAYID_TASK), node and rank. A sweep: every point's, each
    line prefixed with its point too. The last 1000 lines unless asked for more: a week's
    logs are read from their ends, not from the start.

    \b
    jobgen logs RUN -f                     # follow a live job, all nodes and ranks
    jobgen logs RUN --task 2 --rank 3      # one rank of one array task
    jobgen logs RUN --grep 'loss|ERROR'    # every match since the run began
    jobgen logs RUN --all                  # every line"""
    if every_line and last is not None:
        fail("jobgen logs: --all and --tail are two answers to one question: give one", 2)
    if last is None and not every_line and pattern is None:
        last = LOGS_TAIL  # else None: every line
    try:
        grep = re.compile(pattern) if pattern else None
    except (re.error, OverflowError, RecursionError) as exc:  # 'a{99999999999}' overflows; '((((...' recurses
        fail(f"jobgen logs: --grep {pattern!r} is no regular expression Python can use: {exc}", 2)
    filters = Filters(task=task, node=node, rank=rank, grep=grep)
    sources, over = _what_to_read(run_ref)
    if task is not None and not follow and not sources(Filters(task=task)):
        # A task the logs do not know is a wrong name, not an empty log: say which there are.
        known = sorted({s.name for s in sources(Filters())}, key=lambda n: (len(n), n))
        there = f"its tasks: {', '.join(known[:20])}{' ...' if len(known) > 20 else ''}" if known else "no logs yet"
        fail(f"jobgen logs: no task {visible(task)!r} in {visible(run_ref)} ({there})", 1)
    if rank is not None:  # ranks --rank cannot find: say where they are instead of printing nothing
        for where in unknown_ranks(sources(Filters(task=task, node=node))):
            click.echo(f"jobgen logs: {where}: global ranks unknown (no rank map); --node shows them", err=True)
    _show(sources, over, filters, follow=follow, last=last)


def _show(sources: Sources, over: Callable[[], bool], filters: Filters, *, follow: bool, last: int | None) -> None:
    """Every line, or the ``last`` ones (read from the files' ends); then, following, new ones."""
    if not follow and last is None:
        for line in merged(sources(filters), filters):
            click.echo(line)
        return
    if not follow:
        newest = tail(sources(filters), filters, last)
        for line in newest.lines:
            click.echo(line)
        if newest.left_out:
            click.echo(f"jobgen logs: the last {last} lines; --tail N for more, --all for every line", err=True)
        return
    try:
        follow_logs(lambda: sources(filters), filters, click.echo, until=_finished(over), last=last)
    except KeyboardInterrupt:
        pass
