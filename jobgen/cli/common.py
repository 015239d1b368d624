"""What the ``jobgen`` commands share: how they fail (a message on stderr and an exit
status, never a traceback) and how they find their inputs (a run.toml, a run directory).

Used by jobgen.cli.main and the command bodies it delegates to (jobgen.cli.submit,
jobgen.cli.status), which cannot import jobgen.cli.main itself without a cycle. Like jobgen.cli.main,
it imports what it needs inside each function: ``jobgen --help`` must stay fast.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import click

# The modules of jobgen's [train] extra a command needs (pyproject.toml).
TRAIN_EXTRA_MODULES = ("torch", "transformers", "datasets", "tokenizers")

# What a user without a cluster is told when Slurm cannot be reached.
NO_CLUSTER = "no cluster here? `jobgen cluster up --netns` starts a local one"


def fail(message: str, code: int = 1) -> NoReturn:
    """``message`` on stderr, its control characters made visible (it may quote a file:
    jobgen.base.visible), and exit with ``code``."""
    from jobgen.base.visible import visible_lines

    click.echo(visible_lines(message), err=True)
    sys.exit(code)


class Commands(click.Group):
    """The ``jobgen`` group (and any group under it). A damaged file that a command needs and
    did not handle itself (jobgen.base.safe_read.DamagedFile) ends the command with one line that
    names the file, exit status 1: never a traceback. Commands that can show the rest (the
    listing of runs, compare) or that document another status (export) handle it first.

    ``lazy``: commands built only when they are asked for (name -> a function that builds one):
    ``jobgen status`` runs every few minutes in the watchdogs' jobs, and need not import the
    dev cluster's, the watchdogs' or the server's command groups to do so."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy: dict[str, Callable[[], click.Command]] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            self.add_command(self.lazy[name](), name)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        from jobgen.base.safe_read import DamagedFile

        try:
            return super().invoke(ctx)
        except DamagedFile as exc:
            command = f"jobgen {ctx.invoked_subcommand}" if ctx.invoked_subcommand else "jobgen"
            fail(f"{command}: {exc}")


def load(spec_file: str, loader: Callable[[str], Any] | None = None):
    """``loader(spec_file)`` (a run: jobgen.spec.loader.load_run), or every problem it found,
    each by file and key, and exit status 2."""
    from jobgen.spec.loader import SpecError, load_run

    try:
        return (loader or load_run)(spec_file)
    except SpecError as exc:
        lines = "\n".join(f"  {issue}" for issue in exc.issues)
        fail(f"{spec_file}: {len(exc.issues)} problem(s):\n{lines}", 2)


@contextmanager
def submission_errors(no_cluster_hint: str) -> Iterator[None]:
    """A refused submission as its findings (exit status 2), Slurm out of reach with
    ``no_cluster_hint``, any other Slurm or run-directory error as one line (exit status 1)."""
    from jobgen.base.safe_read import DamagedFile
    from jobgen.launch.submission import SubmitError
    from jobgen.runs.rundir import RunDirError
    from jobgen.slurm.client import SlurmError, SlurmUnavailable

    try:
        yield
    except SubmitError as exc:
        click.echo(f"jobgen: not submitted, {len(exc.findings)} problem(s):", err=True)
        print_findings(exc.findings)
        sys.exit(2)
    except SlurmUnavailable as exc:
        fail(f"jobgen: not submitted: {exc}\n  {no_cluster_hint}")
    except (SlurmError, RunDirError, DamagedFile) as exc:
        fail(f"jobgen: not submitted: {exc}")


def default_runs_root() -> Path | None:
    from jobgen.runs.rundir import default_runs_root as runs_root

    return runs_root()


def find_run(ref: str):
    from jobgen.runs.rundir import RunDirError
    from jobgen.runs.sweep_runs import find_run_or_point

    try:
        return find_run_or_point(ref, default_runs_root())
    except RunDirError as exc:
        fail(f"jobgen: {exc}")


def print_findings(findings) -> None:
    for finding in findings:
        click.echo(f"  {finding}", err=finding.level != "info")


def need_extra(extra: str, modules: tuple[str, ...], command: str) -> None:
    """Fail in one line, before anything is written, when this environment lacks one of the
    ``modules`` of jobgen's ``extra`` that ``command`` needs (a traceback of ModuleNotFoundError
    said neither). Looked up without importing (torch's import alone takes seconds)."""
    import importlib.util

    for module in modules:
        try:
            found = sys.modules.get(module, True) is not None and importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing; a module without a spec
            found = False
        if not found:
            fail(
                f"jobgen {command} needs the [{extra}] extra ({module} is not installed in {sys.prefix}): "
                f"pip install 'jobgen[{extra}]'",
                1,
            )
