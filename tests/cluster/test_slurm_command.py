"""Your own program under jobgen's lifecycle (job.program = "command"), on the dev cluster,
side by side (3 nodes: 2 + 1):

- examples/hf_sft.py, a Hugging Face Trainer script with JobgenCallback, as a 3-task array
  on 2 nodes: Slurm's lead-time signal saves and stops task 1 before its 2-minute limit,
  task 2 resumes from that checkpoint with no step computed twice, the kill switch stops
  it with a checkpoint and task 3 burns through; status shows the steps and the reasons;
- examples/torch_loop.py, a plain torch loop with runtime.lifecycle(), on 1 node: a
  ``scancel --signal=USR1`` and the time limit each save and stop a task, and the next
  task continues from the step saved.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import (
    DATA,
    command_spec,
    jobgen,
    last_step,
    submit,
    task_event,
    wait_for,
    wait_until_gone,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.base.paths import EXAMPLES_DIR
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

STOPPED_FOR_TIME = (ExitCode.SIGNALLED, ExitCode.DEADLINE)


def example_spec(tmp_path: Path, name: str, script: str, args: list[str], *, nodes: int, array: int) -> Path:
    """An example script (it reads jobgen's stop request: no signal forwarded), 2 ranks a node."""
    example = EXAMPLES_DIR / script
    return command_spec(tmp_path, name, example, args, nodes=nodes, procs_per_node=2, array=array, stop_signal="none")


def slurm_record(job_id: int) -> dict[str, str]:
    (record,) = slurm.show_job(job_id)
    return record


def test_an_hf_trainer_and_a_plain_loop_stop_save_and_resume_like_the_bundled_trainer(cluster, tmp_path, tiny_model):
    hf_run, loop_run = tmp_path / "runs" / "hf", tmp_path / "runs" / "loop"
    hf_args = ["--model", str(tiny_model), "--data", str(DATA), "--max-steps", "100000", "--save-steps", "100000"]
    hf = submit(example_spec(tmp_path, "hf", "hf_sft.py", hf_args, nodes=2, array=3))
    loop = submit(example_spec(tmp_path, "loop", "torch_loop.py", ["--steps", "100000"], nodes=1, array=3))

    # The plain loop: scancel --signal=USR1 reaches every process; it saves and stops.
    started = wait_for(lambda: task_event(loop_run, 1, "first_step"), 150, "the loop to take steps")
    wait_for(lambda: last_step(loop_run, started["job_id"]) >= 5, 60, "five steps of the loop")
    # scancel may exit 229 ("already completing") for a step of the job while it signals the
    # others (Slurm 22.05 here): what counts is that the program saved and stopped.
    subprocess.run(["scancel", "--signal=USR1", f"{loop}_1"], capture_output=True, check=False)
    stopped = wait_for(lambda: task_event(loop_run, 1, "exit"), 90, "the loop to save and exit")
    assert stopped["exit_code"] == ExitCode.SIGNALLED, stopped
    assert stopped["exit_reason"].startswith("SIGUSR1 (scancel --signal)"), stopped
    saved = stopped["end_step"]
    assert (loop_run / "checkpoints" / f"step-{saved:08d}.pt").is_file()
    resumed = wait_for(lambda: task_event(loop_run, 2, "first_step"), 120, "the loop's task 2 to step")
    assert resumed["start_step"] == saved and resumed["step"] == saved + 1, resumed

    # The HF Trainer: Slurm's lead-time signal saves and stops its first task.
    limited = wait_for(lambda: task_event(hf_run, 1, "exit"), 240, "the Trainer's task 1 to meet its limit")
    assert limited["exit_code"] in STOPPED_FOR_TIME and limited["exit_reason"].startswith("time limit"), limited
    k = limited["end_step"]
    assert (hf_run / "checkpoints" / f"checkpoint-{k}" / "trainer_state.json").is_file()
    again = wait_for(lambda: task_event(hf_run, 2, "first_step"), 150, "the Trainer's task 2 to step")
    assert again["start_step"] == k and again["step"] == k + 1, again  # no step computed twice
    record = slurm_record(int(limited["job_id"]))  # ended: task 2 runs
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), record
    assert record["Comment"].startswith("jobgen: time limit"), record
    # The kill switch, long before task 2's own limit: it saves and stops; task 3 does not start.
    (hf_run / "switches" / "kill").touch()
    killed = wait_for(lambda: task_event(hf_run, 2, "exit"), 60, "the Trainer to save and stop")
    assert killed["exit_code"] == ExitCode.KILL_SWITCH, killed
    assert (hf_run / "checkpoints" / f"checkpoint-{killed['end_step']}" / "trainer_state.json").is_file()

    # The loop's task 2 meets its time limit; task 3 continues from that save.
    limited = wait_for(lambda: task_event(loop_run, 2, "exit"), 180, "the loop's task 2 to meet its limit")
    assert limited["exit_code"] in STOPPED_FOR_TIME, limited
    third = wait_for(lambda: task_event(loop_run, 3, "first_step"), 120, "the loop's task 3 to step")
    assert third["start_step"] == limited["end_step"], third
    (loop_run / "switches" / "kill").touch()
    wait_until_gone([hf, loop], timeout=120)

    view = json.loads(jobgen("status", str(hf_run), "--json", check=True).stdout)
    rows = {t["slurm_id"]: t for t in view["tasks"]}
    assert view["step"] == killed["end_step"], view
    assert rows[f"{hf}_1"]["exit_reason"].startswith("time limit"), rows
    assert rows[f"{hf}_2"]["exit_reason"].startswith("kill switch"), rows
    assert rows[f"{hf}_2"]["recomputed_steps"] == 0, rows
    assert rows[f"{hf}_3"]["jobgen_exit"] == 0 and "kill switch present" in rows[f"{hf}_3"]["comment"], rows
    assert view["goodput"] is not None and 0 < view["goodput"] < 1, view
