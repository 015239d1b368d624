"""Fixtures of the unit tests that read a run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobgen.rundir import RunDir
from run_dirs import unsubmitted_run


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    """A run directory with only its spec.json: never submitted, nothing recorded yet."""
    return unsubmitted_run(tmp_path)
