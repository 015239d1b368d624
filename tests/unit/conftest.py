"""Fixtures of the unit tests that read a run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobgen.runs.rundir import RunDir
from run_dirs import unsubmitted_run


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    """A run directory with only its spec.json: never submitted, nothing recorded yet."""
    return unsubmitted_run(tmp_path)


@pytest.fixture()
def sbatch_calls(monkeypatch) -> list[list[str]]:
    """sbatch and squeue replaced, to see what a submission does around them: each call's
    [script, *options] (job ids 101, 102...); nothing is queued. The dev cluster's tests
    submit to real Slurm."""
    from jobgen.slurm import client as slurm

    calls: list[list[str]] = []

    def sbatch(script, options: list[str]) -> int:
        calls.append([str(script), *options])
        return 100 + len(calls)

    monkeypatch.setattr(slurm, "sbatch", sbatch)
    monkeypatch.setattr(slurm, "queue", lambda ids: [])
    return calls
