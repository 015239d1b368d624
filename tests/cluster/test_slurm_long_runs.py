"""Long-run defects where Slurm is involved, on the real dev cluster.

- A stop request left for a job id before its attempt started (what a requeued job
  finds when its earlier attempt died before consuming one) must not stop it.
- A failure that every array task would repeat stops the run after the first task:
  later tasks leave before they launch anything, and ``status`` says why; so does an exit-1
  crash building the model that is an error of the code (issue 32), not only a typed failure.
- Slurm's SIGTERM-to-SIGKILL window (KillWait) is read from the cluster and compared
  with the saves a run has measured, in ``submit`` and ``status``.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import (
    assert_cancelled,
    exit_record,
    first_step_record,
    jobgen,
    last_step,
    ran_tasks,
    read_jsonl,
    running_task,
    status,
    stop_run,
    submit,
    wait_for,
    wait_until_gone,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.runs.rundir import complete_checkpoints_in
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.lifecycle]


@pytest.mark.full
def test_a_stop_request_left_before_the_attempt_started_is_ignored(cluster_run):
    spec, run = cluster_run("stale-stop")
    # A job the run is chained behind: the run's own job id is known while it waits.
    filler = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--job-name=stale-stop-filler",
            "--nodes=1",
            "--time=2",
            "--output=/dev/null",  # not slurm-<id>.out in the working directory
            "--wrap=sleep 15",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    filler_id = int(filler.stdout.strip().split(";")[0])
    array = submit(spec, "--after", str(filler_id))
    (pending,) = slurm.queue([array])
    assert pending.state == "PENDING"
    # What an earlier attempt of this job id would have left behind (both spellings).
    (run / "switches" / f"stop.{pending.job_id}").touch()
    (run / "switches" / f"stop.{pending.job_id}.0").touch()
    task = running_task(array, 1, timeout=180)
    wait_for(lambda: last_step(run, task) >= 5, 180, "training past step 5")
    assert exit_record(run, task) is None  # still training: the stale requests stopped nothing
    assert not list((run / "switches").glob(f"stop.{task}*"))
    stop_run(run, [array])
    assert exit_record(run, task)["exit_code"] == ExitCode.KILL_SWITCH


def test_a_failure_that_would_repeat_stops_the_array_after_one_task(cluster_run):
    spec, run = cluster_run("repeat", save_every_steps=2)
    first = submit(spec)
    task = running_task(first, 1)
    # Any checkpoint: with keep_checkpoints = 2 a given step's directory may be pruned between polls.
    wait_for(lambda: complete_checkpoints_in(run / "checkpoints"), 180, "a checkpoint")
    stop_run(run, [first])
    (run / "switches" / "kill").unlink()
    # Resuming with another seed can never work: every task of the array would load and fail.
    text = spec.read_text().replace("seed = 3", "seed = 4")
    assert text != spec.read_text()
    spec.write_text(text)
    array = submit(spec, "--array", "3")
    wait_until_gone([array], timeout=300)
    tasks = {r["ArrayTaskId"]: r for r in slurm.show_job(array)}
    assert (tasks["1"]["JobState"], tasks["1"]["ExitCode"]) == ("FAILED", f"{int(ExitCode.RESUME_MISMATCH)}:0"), tasks
    assert "seed" in tasks["1"]["Comment"] and tasks["1"]["Comment"].endswith("(exit 17)"), tasks
    failed = json.loads((run / "failed").read_text())
    assert failed["exit_code"] == ExitCode.RESUME_MISMATCH and "seed" in failed["reason"]
    # Tasks 2 and 3 were cancelled in the queue, with the reason (issue 47): nothing of theirs ran.
    assert_cancelled(array, ["2", "3"], "the run stopped in task ")
    assert ran_tasks(run, array) == ["1"]
    view = status(run)
    assert view["state"] == "failed", view
    assert any("train.seed" in n for n in view["notes"]) and any("jobgen submit" in n for n in view["notes"]), view
    # Fixed and resubmitted: the marker goes to history/ and the run continues.
    spec.write_text(text.replace("seed = 4", "seed = 3"))
    again = submit(spec)
    resumed = running_task(again, 1)
    record = wait_for(lambda: first_step_record(run, resumed), 180, "the fixed run's first step")
    assert record["start_step"] >= 2 and not (run / "failed").exists()
    assert list((run / "history").glob("failed-*.json"))
    stop_run(run, [again])
    assert task != resumed


def test_a_crash_building_the_model_stops_a_three_task_array_after_the_first(cluster, tmp_path, tiny_model):
    """A model whose config.json transformers cannot build (a rope type it does not know: a
    KeyError as the model is constructed, exit 1): the first task writes the failed marker,
    tasks 2 and 3 leave without launching anything."""
    import shutil

    from helpers import train_spec

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    config = json.loads((broken / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "no-such-rope", "factor": 2.0}
    (broken / "config.json").write_text(json.dumps(config))
    spec = train_spec(tmp_path, broken, "broken", runs_root=tmp_path / "runs", array=3)
    run = tmp_path / "runs" / "broken"
    array = submit(spec)
    wait_until_gone([array], timeout=300)
    tasks = {r["ArrayTaskId"]: r for r in slurm.show_job(array)}
    assert (tasks["1"]["JobState"], tasks["1"]["ExitCode"]) == ("FAILED", f"{int(ExitCode.CRASHED)}:0"), tasks
    failed = json.loads((run / "failed").read_text())
    assert failed["reason"].startswith("crashed before its first step (KeyError at "), failed
    assert "as every task would" in failed["reason"], failed
    assert_cancelled(array, ["2", "3"], "the run stopped in task ")  # nothing of theirs ran (issue 47)
    assert ran_tasks(run, array) == ["1"]
    assert status(run)["state"] == "failed"


def test_submit_and_status_warn_when_a_save_does_not_fit_in_killwait(cluster_run):
    spec, run = cluster_run("killwait", max_steps=3, save_every_steps=1)
    job = submit(spec)
    wait_until_gone([job], timeout=240)
    (done,) = [r for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "exit"]
    assert done["exit_code"] == 0
    quick = status(run)
    assert not any("KillWait" in w for w in quick["warnings"]), quick
    # The same run, as if its saves had taken 45 s: more than the dev cluster's KillWait (30 s).
    lines = read_jsonl(run / "tasks.jsonl")
    for line in lines:
        if line["event"] == "exit":
            line["save_seconds"] = [45.0]
    (run / "tasks.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    slow = status(run)
    assert any("KillWait is 30s" in w and "45.0s" in w for w in slow["warnings"]), slow
    dry = jobgen("submit", str(spec), "--dry-run")
    assert dry.returncode == 0 and "KillWait is 30s" in dry.stderr, dry.stdout + dry.stderr
