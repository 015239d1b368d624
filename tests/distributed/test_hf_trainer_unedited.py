"""A Hugging Face Trainer script nobody edited (tests/scripts/run_clm_like.py, of the shape
of transformers' run_clm.py) through stops and resumes, as ``program = "command"``:
jobgen.launch.command_plan writes each task's plan as the batch script does, and ``torchrun
--standalone --nproc-per-node=2 -m jobgen.runtime.launch --plan ...`` runs it on gloo/CPU
with the environment the batch script gives (JOBGEN_RUN_DIR, SLURM_JOB_ID,
SLURM_RESTART_COUNT, the job's end). The same on the dev cluster, through time limits, is
the cluster tests' part.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DATA, REPO, VENV_BIN, read_jsonl, run_spec, wait_for
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.render import render
from jobgen.runs.materialize import materialize
from jobgen.runs.rundir import RunDir
from jobgen.spec.loader import load_run

pytestmark = pytest.mark.torch

SCRIPT = REPO / "tests" / "scripts" / "run_clm_like.py"
MAX_STEPS, SAVE_STEPS = 16, 4


def hf_run(tmp_path: Path, tiny_model: Path, *, output_dir: str = "{checkpoint_dir}", **command: object) -> RunDir:
    """A run of the unedited script: about 0.3 s a step on 2 CPU ranks, so a test can stop it
    mid-run; a checkpoint every SAVE_STEPS steps."""
    args = ["--model_name_or_path", str(tiny_model), "--train_file", str(DATA), "--output_dir", output_dir]
    args += ["--max_steps", str(MAX_STEPS), "--save_steps", str(SAVE_STEPS), "--per_device_train_batch_size", "4"]
    args += ["--block_size", "1024", "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--seed", "3"]
    args += ["--disable_tqdm", "true", "--run_name", "task-{task}-of-job-{job_id}"]
    spec_file = run_spec(
        tmp_path,
        "hf",
        job={"program": "command", "time": "1h", "exit_grace": "1m", "runs_root": "runs", "array": 4},
        command={"script": str(SCRIPT), "args": args, **command},
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run


def task_env(run: RunDir, job_id: str, tmp_path: Path) -> dict[str, str]:
    """What the batch script exports for a task of job ``job_id`` on this machine."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "JOBGEN_RUN_DIR": str(run.path),
        "SLURM_JOB_ID": job_id,
        "SLURM_RESTART_COUNT": "0",
        "SLURM_ARRAY_TASK_ID": job_id[-1],
        "JOBGEN_JOB_START": str(time.time()),
        "JOBGEN_JOB_END_TIME": str(int(time.time() + 3600)),
    }


def start_task(run: RunDir, job_id: str, tmp_path: Path) -> subprocess.Popen[str]:
    """The batch script's two steps for one task: the plan on the head node, then torchrun."""
    env = task_env(run, job_id, tmp_path)
    plan_cmd = [sys.executable, "-m", "jobgen.launch.command_plan", "--run-dir", str(run.path), "--job", job_id]
    subprocess.run([*plan_cmd, "--restart", "0", "--task", env["SLURM_ARRAY_TASK_ID"]], env=env, check=True)
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "jobgen.runtime.launch"]
    cmd += ["--plan", str(run.command_plan(job_id, 0))]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def plan_of(run: RunDir, job_id: str) -> dict:
    return json.loads(run.command_plan(job_id, 0).read_text())


def trainer_steps(out: str) -> int:
    """Steps the Trainer logged in one task (logging_steps 1: one "{'loss': ..." line each, rank 0)."""
    return len(re.findall(r"^\{'loss'", out, flags=re.MULTILINE))


def complete(run: RunDir, step: int) -> bool:
    return (run.checkpoints / f"checkpoint-{step}" / "trainer_state.json").is_file()


def test_hf_trainer_saves_at_the_kill_switch_and_resumes_without_redoing_a_step(tmp_path, tiny_model):
    run = hf_run(tmp_path, tiny_model, hf_trainer=True)
    first = start_task(run, "101", tmp_path)
    assert plan_of(run, "101")["checkpoint"] is None
    wait_for(
        lambda: any(r.get("step", 0) >= 3 for r in read_jsonl(run.path / "metrics.jsonl")),
        180,
        "step 3",
        process=first,
        interval=0.05,
    )
    (run.switches / "kill").touch()
    out = finish(first)
    (run.switches / "kill").unlink()
    tasks = read_jsonl(run.path / "tasks.jsonl")
    stopped = tasks[-1]
    assert stopped["event"] == "exit" and stopped["exit_code"] == ExitCode.KILL_SWITCH, out
    stop_step = stopped["end_step"]
    assert 3 <= stop_step < MAX_STEPS, out
    assert run.exit_code_file("101", 0).read_text().startswith(f"{int(ExitCode.KILL_SWITCH)}\nkill switch"), out
    assert complete(run, stop_step), out  # saved at the stop, whatever the save interval
    # The script's code after train() never ran: no "final" model, no marker.
    assert not (run.checkpoints / "final.txt").exists() and not (run.checkpoints / "model.safetensors").exists()
    assert "the task ends here, before the script's code after train()" in out

    second = start_task(run, "102", tmp_path)
    assert plan_of(run, "102")["checkpoint"] == str(run.checkpoints / f"checkpoint-{stop_step}")
    out = finish(second)
    assert second.returncode == 0, out
    first_step = next(t for t in read_jsonl(run.path / "tasks.jsonl") if t["job_id"] == "102")
    assert first_step["event"] == "first_step" and first_step["start_step"] == stop_step, out
    steps = [r["step"] for r in read_jsonl(run.path / "metrics.jsonl")]
    assert steps == list(range(1, MAX_STEPS + 1)), steps  # each step once: none redone
    assert trainer_steps(out) == MAX_STEPS - stop_step
    assert (run.checkpoints / "final.txt").read_text() == f"final at step {MAX_STEPS}\n"  # saved once
    assert (run.checkpoints / "model.safetensors").is_file() and run.done_marker.exists()
    assert run.exit_code_file("102", 0).read_text().startswith("0\nfinished at step 16")


def test_resume_args_resume_from_the_newest_checkpoint_after_a_sigterm(tmp_path, tiny_model):
    run = hf_run(tmp_path, tiny_model, resume_args=["--resume_from_checkpoint", "{latest_checkpoint}"])
    first = start_task(run, "201", tmp_path)
    assert "--resume_from_checkpoint" not in plan_of(run, "201")["argv"]  # the first task starts fresh
    wait_for(lambda: complete(run, 2 * SAVE_STEPS), 180, "the second checkpoint", process=first, interval=0.05)
    first.send_signal(signal.SIGTERM)  # what stop_signal = "TERM" forwards; torchrun passes it on
    out = finish(first)
    assert first.returncode != 0
    done_first = trainer_steps(out)
    assert not (run.checkpoints / "final.txt").exists()
    newest = max(s for s in range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS) if complete(run, s))
    assert done_first >= newest >= 2 * SAVE_STEPS, out

    second = start_task(run, "202", tmp_path)
    plan = plan_of(run, "202")
    assert plan["argv"][-2:] == ["--resume_from_checkpoint", str(run.checkpoints / f"checkpoint-{newest}")]
    out = finish(second)
    assert second.returncode == 0, out
    assert f"resume_from_checkpoint {run.checkpoints}/checkpoint-{newest}" in out
    done_second = trainer_steps(out)
    assert done_second == MAX_STEPS - newest, out  # resumed at the checkpoint's step
    redone = done_first + done_second - MAX_STEPS
    assert 0 <= redone <= SAVE_STEPS, (done_first, newest)
    assert (run.checkpoints / "final.txt").read_text() == f"final at step {MAX_STEPS}\n"
    # Without hf_trainer jobgen keeps no records of the program's steps: nothing claims it finished.
    assert not run.done_marker.exists()


def test_hf_trainer_refuses_an_output_dir_elsewhere_and_stops_the_run(tmp_path, tiny_model):
    run = hf_run(tmp_path, tiny_model, output_dir=str(tmp_path / "elsewhere"), hf_trainer=True)
    env = task_env(run, "301", tmp_path)
    plan = [sys.executable, "-m", "jobgen.launch.command_plan", "--run-dir", str(run.path), "--job", "301"]
    subprocess.run(plan, env=env)
    cmd = [sys.executable, "-m", "jobgen.runtime.launch", "--plan", str(run.command_plan("301", 0))]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == ExitCode.PROGRAM_SETUP, proc.stdout + proc.stderr
    assert "pass it in [command] args: '--output_dir', '{checkpoint_dir}'" in proc.stderr.lower()
    code, words = run.exit_code_file("301", 0).read_text().splitlines()
    assert int(code) == ExitCode.PROGRAM_SETUP and str(tmp_path / "elsewhere") in words
    failure = run.failure()  # the queued tasks do not start to fail the same way
    assert failure is not None and failure["exit_code"] == ExitCode.PROGRAM_SETUP and "--output_dir" in failure["fix"]
    assert not list((tmp_path / "elsewhere").glob("checkpoint-*"))
