"""What the ``jobgen`` commands share: how they fail (a message on stderr and an exit
status, never a traceback) and how they find their inputs (a run.toml, a run directory).

Used by jobgen.cli and the command bodies it delegates to (jobgen.cli_submit,
jobgen.cli_status), which cannot import jobgen.cli itself without a cycle. Like jobgen.cli,
it imports what it needs inside each function: ``jobgen --help`` must stay fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import click


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(code)


def load(spec_file: str):
    from jobgen.loader import SpecError, load_run

    try:
        return load_run(spec_file)
    except SpecError as exc:
        lines = "\n".join(f"  {issue}" for issue in exc.issues)
        fail(f"{spec_file}: {len(exc.issues)} problem(s):\n{lines}", 2)


def default_runs_root() -> Path | None:
    from jobgen.rundir import default_runs_root as runs_root

    return runs_root()


def find_run(ref: str):
    from jobgen.rundir import RunDirError
    from jobgen.rundir import find_run as find

    try:
        return find(ref, default_runs_root())
    except RunDirError as exc:
        fail(f"jobgen: {exc}")


def print_findings(findings) -> None:
    for finding in findings:
        click.echo(f"  {finding}", err=finding.level != "info")
