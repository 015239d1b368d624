"""Memory snapshots (issue 35, train.snapshot_every_steps), run on this machine as ``jobgen
submit --local`` runs the batch script: a crash between disk checkpoints is relaunched inside
the task and resumes from the newest snapshot on the tmpfs, redoing fewer steps than the disk
checkpoint would, with every loss equal to an uninterrupted run's; the task deletes them as it
ends. Two ranks on two nodes of the dev cluster: tests/cluster/test_slurm_in_job_restarts.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import PLANTED_CRASHES, REPO, assert_same_training, fault_dir, make_run, read_jsonl
from jobgen.launch.submit import local_environment
from jobgen.runs.rundir import RunDir

pytestmark = [pytest.mark.torch, pytest.mark.lifecycle]

SITE = {"profile": "local", "slurm": {"in_job_restarts": 2}}
MAX_STEPS, SAVE_EVERY, SNAPSHOT_EVERY = 16, 10, 3


def run_task(run: Path, job_id: int, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """The run's batch script as one task of job ``job_id`` on this machine; its environment."""
    rd = RunDir(run)
    environment = {
        **local_environment(rd.load_spec(), job_id),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": f"{env.pop('PLANT', '')}{os.pathsep}{REPO}",
        **env,
    }
    proc = subprocess.run(
        ["bash", str(rd.script("train"))], env=environment, cwd=run, capture_output=True, text=True, timeout=400
    )
    return proc, proc.stdout + proc.stderr


def test_a_crash_between_checkpoints_resumes_from_the_newest_snapshot(tmp_path, tiny_model):
    keys = {"max_steps": MAX_STEPS, "save_every_steps": SAVE_EVERY, "snapshot_every_steps": SNAPSHOT_EVERY}
    run = make_run(tmp_path / "crash", tiny_model, site=SITE, **keys)
    reference = make_run(tmp_path / "ref", tiny_model, site=SITE, **keys)
    plant = fault_dir(tmp_path, PLANTED_CRASHES)
    # The rank crashes in its 8th optimizer step of the first launch only: steps 1-7 were
    # taken, snapshots at 3 and 6, no checkpoint on disk yet (every 10).
    proc, out = run_task(run, 7373, PLANT=str(plant), CRASH_AT="8", CRASH_LAUNCH="0")
    assert proc.returncode == 0, out[-4000:]
    assert "relaunching the program inside this task (relaunch 1 of at most 2)" in out, out[-4000:]
    starts = [
        (r.get("launch", 0), r["start_step"]) for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "first_step"
    ]
    assert starts == [(0, 0), (1, 6)], starts  # 1 step redone, not 7
    assert "resumed from snapshot-step-00000006 at step 6" in out, out[-4000:]
    assert (run / "done").exists()

    ref_proc, ref_out = run_task(reference, 7374)
    assert ref_proc.returncode == 0, ref_out[-4000:]
    assert_same_training(run, reference, MAX_STEPS)

    # The task freed the tmpfs: nothing of either job's snapshots is left.
    spec = RunDir(run).load_spec()
    left = list(Path(spec.site.paths.snapshot_dir).glob(f"jobgen-{os.getuid()}/*/7373.0"))
    assert not left, left
