"""Pipeline parallelism on the dev cluster (``train.parallelism = "pipeline"``): two nodes, one
process each, so every activation and gradient between the stages crosses the nodes' own
network namespaces (gloo over TCP, as a pipeline crosses Ethernet between machines).

- Under each schedule torch runs on CPU, a run stopped mid-way by Slurm's lead-time signal
  resumes in its next array task, and every step's loss and gradient norm equal those of the
  unpipelined run with the same micro_batch_size on one process. Two schedules run in CI (one
  stage per rank, and two per rank in a V); the others are marked ``full``.
- A real 2-minute time limit stops a pipelined job at a step boundary before Slurm would kill
  it (COMPLETED, the checkpoint at that step); the chained array task resumes there; a kill
  switch then stops it within one step.
"""

from __future__ import annotations

import pytest

from helpers import (
    ClusterRun,
    exit_record,
    first_step_record,
    last_step,
    losses,
    metric,
    read_jsonl,
    running_task,
    stopped_at_lead_time_then_finished,
    submit,
    train_spec,
    wait_for,
    wait_until_gone,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.model.pipeline_split import SCHEDULES
from jobgen.slurm import client as slurm
from trainer.checkpoints.checkpointer import complete_checkpoints

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

MAX_STEPS = 8
STOP_AFTER = 3
IN_CI = ("1f1b", "zbv-zero-bubble")


@pytest.fixture()
def deep_run(cluster, tmp_path, deep_model):
    def make(name: str, **keys: object) -> ClusterRun:
        root = tmp_path / "runs"
        return ClusterRun(train_spec(tmp_path, deep_model, name, runs_root=root, **keys), root / name)

    return make


def pipeline(schedule: str, **keys: object) -> dict[str, object]:
    return {"nodes": 2, "procs_per_node": 1, "parallelism": "pipeline", "pipeline": {"schedule": schedule}, **keys}


def ended(job: int) -> dict[str, str] | None:
    """The job's record once Slurm no longer runs it (the trainer's exit line comes first)."""
    (record,) = slurm.show_job(job)
    return record if record["JobState"] not in ("RUNNING", "COMPLETING") else None


@pytest.mark.parametrize("schedule", [pytest.param(s, marks=() if s in IN_CI else pytest.mark.full) for s in SCHEDULES])
def test_schedule_across_two_nodes_equals_one_process_and_resumes_exactly(deep_run, schedule):
    reference = deep_run(f"one-{schedule}", nodes=1, procs_per_node=1, max_steps=MAX_STEPS)
    submit(reference.spec)
    run = deep_run(f"pp-{schedule}", array=2, max_steps=MAX_STEPS, **pipeline(schedule))
    job = submit(run.spec)

    first = stopped_at_lead_time_then_finished(run.path, job, STOP_AFTER, MAX_STEPS)
    wait_for(lambda: (reference.path / "done").exists(), 300, "the one-process run to finish")

    starts = [r["start_step"] for r in read_jsonl(run.path / "tasks.jsonl") if r["event"] == "first_step"]
    assert starts == [0, first["end_step"]], starts
    got, expected = losses(run.path), losses(reference.path)
    assert sorted(got) == sorted(expected) == list(range(1, MAX_STEPS + 1)), (sorted(got), sorted(expected))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-5), (step, got, expected)
    norms, expected_norms = metric(run.path, "grad_norm"), metric(reference.path, "grad_norm")
    for step in expected_norms:
        assert norms[step] == pytest.approx(expected_norms[step], rel=1e-3), (step, norms, expected_norms)
    logs = "".join(p.read_text(errors="replace") for p in (run.path / "logs" / "ranks").rglob("*.log"))
    stages = 2 if SCHEDULES[schedule].stages_per_rank == 1 else 4
    assert f"pipeline: {stages} stage(s) over 2 rank(s) x 1 replica(s), schedule {schedule}" in logs


def test_time_limit_then_kill_switch_stop_a_pipeline_at_step_boundaries(deep_run):
    run = deep_run("pp-limit", time_limit="2m", grace="50s", array=2, **pipeline("interleaved-1f1b"))
    job = submit(run.spec)
    task1 = running_task(job, 1, timeout=240)
    done = wait_for(lambda: exit_record(run.path, task1), 240, "the time limit to stop task 1")
    assert done["exit_code"] in (ExitCode.DEADLINE, ExitCode.SIGNALLED), done
    record = wait_for(lambda: ended(task1), 120, "task 1's batch script to end")
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), record
    k = done["end_step"]
    assert [p.name for p in complete_checkpoints(run.path / "checkpoints")] == [f"step-{k:08d}"]

    task2 = running_task(job, 2, timeout=240)
    resumed = wait_for(lambda: first_step_record(run.path, task2), 240, "task 2's first step")
    assert resumed["start_step"] == k and resumed["resumed_from"] == f"step-{k:08d}"
    wait_for(lambda: last_step(run.path, task2) >= k + 2, 120, "task 2 to train")
    (run.path / "switches" / "kill").touch()
    wait_until_gone([job], timeout=240)
    stopped = exit_record(run.path, task2)
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH, stopped
    newest = max(p.name for p in complete_checkpoints(run.path / "checkpoints"))
    assert newest == f"step-{stopped['end_step']:08d}", newest
    # Every step the second task logged continues the first's: no step twice, none skipped.
    steps = [r["step"] for r in read_jsonl(run.path / "metrics.jsonl") if r.get("event") != "eval"]
    assert steps == list(range(1, stopped["end_step"] + 1)), steps
