"""A wrong SLURM_CONF is one line at once (issue 46): Slurm's own commands retry a configuration
file they cannot open for 60 s before they fail, so `jobgen submit --dry-run` waited a minute
to say nothing useful. Here the Slurm commands on PATH are stand-ins that record being run:
with a missing SLURM_CONF none of them may run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from helpers import jobgen, run_spec
from jobgen.slurm import client as slurm


@pytest.fixture
def recording_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sinfo, scontrol, squeue, sbatch, sacct on PATH, each appending its name to ``ran``."""
    bin_dir, ran = tmp_path / "bin", tmp_path / "ran"
    bin_dir.mkdir()
    for name in ("sinfo", "scontrol", "squeue", "sbatch", "sacct"):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\necho {name} >> {ran}\nexit 1\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return ran


def test_a_missing_slurm_conf_is_refused_before_any_slurm_command_runs(recording_slurm, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such-slurm.conf"))
    with pytest.raises(slurm.SlurmUnavailable) as refused:
        slurm.run(["scontrol", "show", "config"])
    assert f"SLURM_CONF={tmp_path / 'no-such-slurm.conf'}: no such file" in str(refused.value)
    assert not recording_slurm.exists()


def test_submit_dry_run_names_the_missing_slurm_conf(recording_slurm, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    spec = run_spec(tmp_path, "conf", job={"time": "1h", "runs_root": "runs"}, model={"path": "model"},
                    data={"path": "data.jsonl"})  # fmt: skip
    done = jobgen("submit", str(spec), "--dry-run", env={"SLURM_CONF": str(tmp_path / "nope.conf")}, timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert f"SLURM_CONF={tmp_path / 'nope.conf'}: no such file" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr and not recording_slurm.exists()


@pytest.mark.parametrize(
    "stderr",
    [
        "slurm_load_jobs error: Insane message length",
        "slurm_load_ctl_conf error: Protocol authentication error",
        "squeue: error: slurm_receive_msg: Zero Bytes were transmitted or received",
        # Slurm 22.05's squeue against a 24.11 controller (captured on the dev cluster).
        "squeue: error: slurm_unpack_received_msg: [[10.213.47.1]:16817] Invalid Protocol Version 10752 from "
        "uid=4294967295: Incompatible versions of client and server code\nslurm_load_jobs error: Unspecified error",
    ],
)
def test_an_answer_that_cannot_be_read_is_slurm_unavailable(stderr):
    """A controller whose answer cannot be read (seen in CI while another dev cluster restarted:
    `jobgen status` exited 1 under a SlurmError traceback) is Slurm not answering: status goes on
    from the run's records and says so."""
    import subprocess

    proc = subprocess.CompletedProcess(["squeue"], 1, stdout="", stderr=stderr)
    error = slurm.failure(["squeue"], proc)
    assert isinstance(error, slurm.SlurmUnavailable) and stderr in str(error)
    # What status shows: the line that says why, not slurm_load_jobs' "Unspecified error" after it.
    assert error.reason in stderr.splitlines() and "Unspecified" not in error.reason
