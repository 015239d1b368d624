"""What the ``jobgen`` commands share: how they fail (a message on stderr and an exit
status, never a traceback) and how they find their inputs (a run.toml, a run directory).

Used by jobgen.cli and the command bodies it delegates to (jobgen.cli_submit,
jobgen.cli_status), which cannot import jobgen.cli itself without a cycle. Like jobgen.cli,
it imports what it needs inside each function: ``jobgen --help`` must stay fast.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import click

# What a user without a cluster is told when Slurm cannot be reached.
NO_CLUSTER = "no cluster here? `jobgen cluster up --netns` starts a local one"


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(code)


def load(spec_file: str, loader: Callable[[str], Any] | None = None):
    """``loader(spec_file)`` (a run: jobgen.loader.load_run), or every problem it found,
    each by file and key, and exit status 2."""
    from jobgen.loader import SpecError, load_run

    try:
        return (loader or load_run)(spec_file)
    except SpecError as exc:
        lines = "\n".join(f"  {issue}" for issue in exc.issues)
        fail(f"{spec_file}: {len(exc.issues)} problem(s):\n{lines}", 2)


@contextmanager
def submission_errors(no_cluster_hint: str) -> Iterator[None]:
    """A refused submission as its findings (exit status 2), Slurm out of reach with
    ``no_cluster_hint``, any other Slurm or run-directory error as one line (exit status 1)."""
    from jobgen.rundir import RunDirError
    from jobgen.slurm import SlurmError, SlurmUnavailable
    from jobgen.submit import SubmitError

    try:
        yield
    except SubmitError as exc:
        click.echo(f"jobgen: not submitted, {len(exc.findings)} problem(s):", err=True)
        print_findings(exc.findings)
        sys.exit(2)
    except SlurmUnavailable as exc:
        fail(f"jobgen: not submitted: {exc}\n  {no_cluster_hint}")
    except (SlurmError, RunDirError) as exc:
        fail(f"jobgen: not submitted: {exc}")


def default_runs_root() -> Path | None:
    from jobgen.rundir import default_runs_root as runs_root

    return runs_root()


def find_run(ref: str):
    from jobgen.rundir import RunDirError
    from jobgen.sweep_runs import find_run_or_point

    try:
        return find_run_or_point(ref, default_runs_root())
    except RunDirError as exc:
        fail(f"jobgen: {exc}")


def print_findings(findings) -> None:
    for finding in findings:
        click.echo(f"  {finding}", err=finding.level != "info")
