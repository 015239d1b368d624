"""``jobgen submit``'s body, behind the options jobgen.cli.main declares: jobgen.launch.submit does the
work (on the submission core: the checks, the run directory, sbatch, or the --local run); this
module turns its outcome into what the command prints and its exit status.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import click

from jobgen.cli.common import NO_CLUSTER, fail, load, print_findings, submission_errors
from jobgen.launch.submit import SubmitResult, run_local
from jobgen.launch.submit import submit as do_submit
from jobgen.runs.rundir import RunDir
from jobgen.spec.resolved import ResolvedSpec


def submit_command(
    spec_file: str,
    *,
    array: int | None,
    after: int | None,
    dry_run: bool,
    local: bool,
    ignore_memory_plan: bool,
    wait: bool,
) -> None:
    """``jobgen submit`` with its options (see jobgen.cli.main.submit)."""
    from jobgen.cli.sweep import submit_sweep_command, sweep_file

    if sweep_file(spec_file):
        if local or array is not None or wait:
            fail("jobgen: a sweep is submitted as one Slurm array: --local, --array and --wait are for single runs")
        submit_sweep_command(spec_file, after=after, dry_run=dry_run, ignore_memory_plan=ignore_memory_plan)
        return
    spec = load(spec_file)
    source = Path(spec_file).read_text()
    with submission_errors(NO_CLUSTER + "; `jobgen submit --local` runs one node on this machine without Slurm"):
        if local:
            _run_local(spec, source, ignore_memory_plan)
        result = do_submit(
            spec,
            source_text=source,
            array=array,
            after=after,
            dry_run=dry_run,
            ignore_memory_plan=ignore_memory_plan,
        )
    print_findings([f for f in result.findings if f.level == "warning"])
    if dry_run:
        print_findings([f for f in result.findings if f.level == "info"])
        click.echo(f"would create/continue {result.run_dir} and run:\n  {' '.join(result.command)}")
        return
    verb = "created" if result.created else "continuing"
    click.echo(f"submitted job {result.job_id} ({verb} {result.run_dir})")
    if wait and spec.run.job.resumable:
        _wait(result, spec.run.job.name)


def _run_local(spec: ResolvedSpec, source: str, ignore_memory_plan: bool) -> NoReturn:
    """--local: run the job on this machine and exit with its status; what the checks found
    is shown before it starts."""
    run, rc = run_local(spec, source_text=source, ignore_memory_plan=ignore_memory_plan, announce=print_findings)
    click.echo(f"local run in {run.path} exited with status {rc}")
    sys.exit(rc)


def _wait(result: SubmitResult, name: str) -> NoReturn:
    """--wait: follow the job to its first step; exit 0 once it trained (or finished), 1 if it
    ended without, 130 on Ctrl-C, which stops the waiting, not the job."""
    from jobgen.report.first_step import wait_for_first_step

    try:
        outcome = wait_for_first_step(RunDir(result.run_dir), result.job_id)
    except KeyboardInterrupt:
        click.echo(f"stopped waiting; job {result.job_id} stays queued (jobgen status {name})")
        sys.exit(130)
    click.echo(outcome.message)
    sys.exit(0 if outcome.trained or outcome.finished else 1)
