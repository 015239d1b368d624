"""Your own program relaunched inside its task (issue 35, job.in_job_restarts with program
"command"), run on this machine as ``jobgen submit --local`` runs it: the batch script writes
the program's plan again before the relaunch, so it resumes from the newest checkpoint the
crashed launch left, in the same task. The bundled trainer's relaunches on the dev cluster:
tests/cluster/test_slurm_in_job_restarts.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import REPO, run_spec
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.render import render
from jobgen.launch.submit import local_environment
from jobgen.runs.materialize import materialize
from jobgen.spec.loader import load_run

pytestmark = [pytest.mark.torch, pytest.mark.lifecycle]

SCRIPT = REPO / "tests" / "scripts" / "crash_once_loop.py"


def test_a_crashed_program_is_relaunched_with_a_plan_that_resumes_from_its_newest_checkpoint(tmp_path):
    command = {
        "script": str(SCRIPT),
        "args": ["{checkpoint_dir}"],
        "resume_args": ["--resume", "{latest_checkpoint}"],
        "checkpoints": "step-*",
    }
    spec_file = run_spec(
        tmp_path,
        "own",
        job={"program": "command", "time": "1h", "runs_root": "runs", "in_job_restarts": 2},
        command=command,
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    env = {**local_environment(spec, 7272), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(run.script("command"))], env=env, cwd=run.path, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    # Launch 0 saved at 5 and crashed at 7; the relaunch's plan named step 5, and it went on from there.
    assert "launch 0 step 7" in out and "launch 0 step 8" not in out, out[-4000:]
    assert "relaunching the program inside this task (relaunch 1 of at most 2)" in out, out[-4000:]
    assert "launch 1 starts after step 5" in out and "launch 1 finished" in out, out[-4000:]
    plan = json.loads(run.command_plan("7272", 0).read_text())
    assert plan["argv"][-2:] == ["--resume", str(run.checkpoints / "step-00005")], plan
    record = json.loads(run.task_record("7272", 0).read_text())
    (relaunch,) = record["restarts"]
    assert relaunch["after_exit"] == ExitCode.CRASHED and record["exit_code"] == 0, record
    assert (run.path / "done").exists()  # the relaunch ended on its own with 0: the run is finished
