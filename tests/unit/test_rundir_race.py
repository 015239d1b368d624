"""Two first submissions of one run at the same moment: one creates the run directory, the
other is refused with a sentence naming it (exit status 2 from the CLI), and neither leaves
a staging directory behind."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import run_spec
from jobgen.launch.render import render
from jobgen.runs.materialize import materialize
from jobgen.runs.rundir import RunDirError, RunDirTaken
from jobgen.spec.loader import load_run


@pytest.fixture()
def spec_file(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    return run_spec(
        tmp_path, "raced", job={"time": "1h", "program": "command", "runs_root": "runs"}, command={"script": "train.py"}
    )


def _staging_renames(monkeypatch: pytest.MonkeyPatch, before) -> None:
    """Call ``before()`` just before a staged run directory is renamed into place."""
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        if str(src).endswith(".staging"):
            before()
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)


def test_two_threads_creating_one_run_one_wins_the_other_is_told(spec_file: Path, monkeypatch: pytest.MonkeyPatch):
    spec = load_run(spec_file)
    barrier = threading.Barrier(2, timeout=30)  # both staged and filled before either renames
    _staging_renames(monkeypatch, barrier.wait)
    results: list[object] = [None, None]

    def submit(index: int) -> None:
        try:
            results[index] = materialize(spec, render(spec), spec_file.read_text())
        except (OSError, RunDirError) as exc:  # the test looks at what each got
            results[index] = exc

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    winners = [r for r in results if isinstance(r, tuple)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1 and len(losers) == 1, results
    run, created = winners[0]
    assert created and run.exists()
    assert isinstance(losers[0], RunDirTaken) and isinstance(losers[0], RunDirError), repr(losers[0])
    assert str(run.path) in str(losers[0]) and "jobgen stop raced" in str(losers[0])
    assert [p.name for p in (spec_file.parent / "runs").iterdir()] == ["raced"]  # no staging left


def test_a_run_that_appears_after_it_was_found_absent_is_not_continued(spec_file: Path):
    spec = load_run(spec_file)
    materialize(spec, render(spec), None)
    with pytest.raises(RunDirTaken):
        materialize(spec, render(spec), None, new_only=True)
    _, created = materialize(spec, render(spec), None)  # a resubmission that checked continues it
    assert not created


def test_the_cli_refuses_the_loser_with_exit_status_2(spec_file: Path, monkeypatch: pytest.MonkeyPatch):
    """``jobgen submit --local``: another submission creates the run while this one is
    staging it; this one stops before running anything, with one sentence and no traceback."""
    from jobgen.cli.main import main

    spec = load_run(spec_file)
    started = []

    def other_submission() -> None:
        if not started:  # the competitor's own rename passes through
            started.append(True)
            materialize(spec, render(spec), None)

    _staging_renames(monkeypatch, other_submission)
    monkeypatch.chdir(spec_file.parent)
    result = CliRunner().invoke(main, ["submit", "--local", str(spec_file)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and "OSError" not in result.output
    assert str(spec.run_dir) in result.output and "jobgen status raced" in result.output
    assert [p.name for p in (spec_file.parent / "runs").iterdir()] == ["raced"]
    assert not list((spec_file.parent / "runs" / "raced" / "logs").iterdir())  # the loser ran nothing
