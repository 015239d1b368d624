"""``jobgen status``'s body, behind the options jobgen.cli.main declares: which runs, their
statuses (jobgen.report.status) from one squeue for all of them, and how they are shown.

The watchdogs' alerts come in as ``alerts``: jobgen.cli.main, the composition root, hands in
``watchdogs.notify.run_alerts``; this module, like the rest of jobgen, imports no watchdogs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from jobgen.cli.common import default_runs_root, fail, find_run
from jobgen.report import stop_requests
from jobgen.report.status import (
    RunStatus,
    WatchdogAlerts,
    queue_for,
    remembered_for,
    run_status,
    unreadable,
    unreadable_status,
    watch_run,
)
from jobgen.report.status_format import format_listing, format_status
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm


def status_command(run_ref: str | None, as_json: bool, watch: bool, alerts: WatchdogAlerts) -> None:
    """``jobgen status`` with its options (see jobgen.cli.main.status)."""
    from jobgen.cli.sweep import status_sweep, sweep_ref

    sweep = sweep_ref(run_ref) if run_ref else None
    if sweep is not None:
        if watch:
            fail(f"jobgen status --watch follows one run: give a point, {run_ref}/POINT (jobgen status {run_ref})")
        return status_sweep(sweep, as_json)  # one line per point
    run = _readable_run(run_ref) if run_ref else None
    if watch:
        if run is None:
            fail("jobgen status --watch needs RUN")
        final = watch_run(run, click.echo, watchdog_alerts=alerts)
        click.echo(format_status(final))
        sys.exit(0 if final.state == "finished" else 1)
    runs = [run] if run is not None else _all_runs()
    problems = {r: unreadable(r) for r in runs}
    statuses = _statuses(runs, problems, alerts, details=run is not None)
    for status in statuses:  # stop requests of ended attempts (jobgen.report.stop_requests)
        stop_requests.remove(Path(p) for p in status.stale_stop_requests)
    _show(statuses, as_json=as_json, one_run=run is not None)
    sys.exit(1 if any(problems.values()) else 0)


def _readable_run(run_ref: str) -> RunDir:
    """The run RUN names; a one-line error (exit status 1) when its records cannot be read."""
    run = find_run(run_ref)
    problem = unreadable(run)
    if problem:
        fail(f"jobgen: {problem}")
    return run


def _all_runs() -> list[RunDir]:
    from jobgen.runs.sweep_runs import listed_points

    root = default_runs_root()
    if root is None:
        return []
    runs = [RunDir(p.parent) for p in root.glob("*/spec.json")]
    runs += listed_points(root)  # sweeps' points
    return sorted(runs, key=lambda r: r.path)


def _statuses(
    runs: list[RunDir], problems: dict[RunDir, str | None], alerts: WatchdogAlerts, *, details: bool
) -> list[RunStatus]:
    """Each run's status, from one squeue call for all of them; an unreadable run's entry
    names the file and the error."""
    readable = [r for r in runs if not problems[r]]
    queue: list[slurm.QueueEntry] | Exception
    conf: dict[str, str] | Exception | None = None
    remembered: list[slurm.JobRecord] | None = None
    try:
        queue = queue_for(readable)
        # One configuration for every run: the listing asks about ended jobs as one run's view
        # does (ended=True), so both tell a task's state, and the run's, the same way; and
        # once for all of them (one sacct), not once per run.
        conf = slurm.config() if any(r.jobs() for r in readable) else None
        remembered = remembered_for(readable, queue, conf) if len(readable) > 1 else None
    except slurm.SlurmUnavailable as exc:
        queue = exc  # each run says so in its notes
    return [
        unreadable_status(r, problems[r])
        if problems[r]
        else run_status(r, alerts, queue=queue, details=details, ended=True, conf=conf, remembered=remembered)
        for r in runs
    ]


def _show(statuses: list[RunStatus], *, as_json: bool, one_run: bool) -> None:
    if as_json:
        payload = statuses[0].to_json() if one_run else [s.to_json() for s in statuses]
        click.echo(json.dumps(payload, indent=2))
    elif not statuses:
        click.echo(f"no runs under {default_runs_root()}")
    elif one_run:
        click.echo(format_status(statuses[0]))
    else:
        click.echo(format_listing(statuses))
