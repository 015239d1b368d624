"""A sweep's points as runs: SWEEP and SWEEP/POINT as names, the job name and job ids Slurm
knows a point's tasks by, W&B's group, and ``jobgen status SWEEP`` from the files (a sweep
with no job queued: Slurm is not asked)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from helpers import jobgen, small_sweep
from jobgen import slurm
from jobgen.rundir import RunDir
from jobgen.sweep_points import load_sweep
from jobgen.sweep_runs import find_point, find_sweep, slurm_view, sweep_name
from jobgen.sweep_status import format_sweep_status, sweep_status
from jobgen.sweep_submit import submit_sweep


@pytest.fixture()
def sweep(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setattr(slurm, "sbatch", lambda script, options: 41)
    monkeypatch.setattr(slurm, "queue", lambda ids: [])
    path = small_sweep(tmp_path, train={"report_to": ["wandb"]})
    submit_sweep(load_sweep(path), source_text=path.read_text(), skip_preflight=True)
    return tmp_path / "runs" / "lrs"


def claim(sweep: Path, point: str, job_id: int, task: int) -> None:
    line = {"point": point, "job_id": str(job_id), "array_job_id": "41", "task": str(task), "restart": 0}
    with open(sweep / "claims.jsonl", "a") as handle:
        handle.write(json.dumps(line) + "\n")
    (sweep / "claims").mkdir(exist_ok=True)
    (sweep / "claims" / f"{point}.json").write_text(json.dumps(line))


def test_names_find_the_sweep_and_its_points(sweep):
    root = sweep.parent
    assert find_sweep("lrs", root) == sweep and find_sweep(str(sweep), None) == sweep.absolute()
    assert find_point("lrs/lr-0.001", root).path == sweep / "lr-0.001"
    assert find_point("lrs/../lrs", root) is None and find_point("lrs/nope", root) is None
    assert find_sweep("lrs/lr-0.001", root) is None


def test_a_points_tasks_are_the_sweeps_job_with_the_ids_that_claimed_it(sweep):
    claim(sweep, "lr-0.001", 42, 1)
    claim(sweep, "lr-0.002", 43, 2)
    claim(sweep, "lr-0.001", 44, 3)
    assert slurm_view(RunDir(sweep / "lr-0.001"), "lr-0.001") == ("lrs", {42, 44})
    assert slurm_view(RunDir(sweep / "lr-0.002"), "lr-0.002") == ("lrs", {43})
    single = RunDir(sweep.parent / "alone")
    assert slurm_view(single, "alone") == ("alone", None) and sweep_name(single) is None


def test_wandb_groups_a_sweeps_points_under_the_sweeps_name(sweep, monkeypatch):
    from trainer.tracking import trackers_for_run

    calls: list[dict] = []
    fake = types.SimpleNamespace(
        init=lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(finish=lambda: None)
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = RunDir(sweep / "lr-0.002")
    trackers_for_run(run.load_spec(), run, 0, enabled=True)
    assert [(c["group"], c["name"]) for c in calls] == [("lrs", "lr-0.002")]


def test_status_of_a_sweep_names_each_points_state(sweep):
    (sweep / "lr-0.001" / "done").write_text("{}")
    (sweep / "lr-0.001" / "metrics.jsonl").write_text(
        json.dumps({"time": 1764219600.0, "step": 5, "loss": 1.25}) + "\n"
    )
    status = sweep_status(sweep)
    assert [(p["name"], p["state"], p["step"], p["loss"]) for p in status["points"]] == [
        ("lr-0.001", "finished", 5, 1.25),
        ("lr-0.002", "stopped", None, None),  # no job of the sweep is left to run it
    ]
    assert status["state"] == "stopped" and status["jobs"] == [41]
    text = format_sweep_status(status)
    assert "lr-0.001  finished" in text and "train.lr=0.001" in text and "5/" in text


def test_jobgen_status_and_stop_take_a_sweep(sweep):
    env = {"JOBGEN_RUNS_ROOT": str(sweep.parent)}
    out = jobgen("stop", "lrs/lr-0.002", env=env, check=True)
    assert (sweep / "lr-0.002" / "switches" / "kill").is_file() and not (
        sweep / "lr-0.001" / "switches" / "kill"
    ).exists()
    out = jobgen("stop", "lrs", env=env, check=True)
    assert (sweep / "lr-0.001" / "switches" / "kill").is_file(), out.stdout
    assert "already set" in out.stdout


def entry(job_id: int, task: str, state: str) -> slurm.QueueEntry:
    start = 1764219600.0 if state == "RUNNING" else None
    return slurm.QueueEntry(job_id, 41, task, state, "None", "0:10", "2:00", "node1", "lrs", start)


def test_a_points_status_has_its_own_tasks_and_while_open_the_arrays_waiting_ones(sweep):
    from jobgen.status import run_status

    claim(sweep, "lr-0.001", 42, 1)
    claim(sweep, "lr-0.002", 43, 2)
    # Task 1 runs lr-0.001, task 2 lr-0.002; tasks 3-4 have not started (they carry the array's id).
    queue = [entry(42, "1", "RUNNING"), entry(43, "2", "RUNNING"), entry(41, "[3-4%2]", "PENDING")]
    mine = run_status(RunDir(sweep / "lr-0.001"), queue=queue, details=False, ended=False)
    assert [(t.job_id, t.state) for t in mine.tasks] == [(41, "PENDING"), (42, "RUNNING")], mine.tasks
    assert mine.state == "running"
    (sweep / "lr-0.002" / "done").write_text("{}")  # finished: the array's waiting tasks are not its
    theirs = run_status(RunDir(sweep / "lr-0.002"), queue=queue, details=False, ended=False)
    assert [t.job_id for t in theirs.tasks] == [43], theirs.tasks


def test_compare_calls_a_point_with_its_kill_switch_stopped(sweep):
    from jobgen.compare import compare

    (sweep / "lr-0.002" / "metrics.jsonl").write_text(json.dumps({"time": 1764219600.0, "step": 2, "loss": 2.5}) + "\n")
    RunDir(sweep / "lr-0.002").set_switch("kill")
    rows = {row.name: row.state for row in compare([str(sweep)], None)}
    assert rows == {"lr-0.001": "submitted", "lr-0.002": "stopped"}


def test_the_listing_of_runs_has_every_point_of_a_sweep(sweep, monkeypatch):
    from jobgen import cli_status

    (sweep.parent / "alone").mkdir()
    (sweep.parent / "alone" / "spec.json").write_text((sweep / "lr-0.001" / "spec.json").read_text())
    monkeypatch.setattr(cli_status, "default_runs_root", lambda: sweep.parent)
    assert [r.path for r in cli_status._all_runs()] == [sweep.parent / "alone", sweep / "lr-0.001", sweep / "lr-0.002"]


def test_a_sweep_without_slurm_to_ask_is_unknown_not_stopped(sweep, monkeypatch):
    def unreachable(ids):
        raise slurm.SlurmUnavailable(["squeue"], 124, "no answer within 60s (is slurmctld up?)")

    monkeypatch.setattr(slurm, "queue", unreachable)
    status = sweep_status(sweep)
    assert [p["state"] for p in status["points"]] == ["unknown", "unknown"] and status["state"] == "unknown"
    assert "Slurm not reachable" in status["notes"][0]


def test_a_sweep_index_that_cannot_be_read_is_a_sentence(sweep):
    env = {"JOBGEN_RUNS_ROOT": str(sweep.parent)}
    (sweep / "sweep.json").write_text('{"points": [{"name": "x"}]}')
    for command in (["status", "lrs"], ["stop", "lrs"], ["logs", "lrs"]):
        out = jobgen(*command, env=env)
        assert out.returncode != 0 and "Traceback" not in out.stderr and "sweep.json" in out.stderr, (command, out)


def test_serve_and_status_watch_take_a_point_not_a_sweep(sweep):
    from jobgen.serve import find_target

    assert find_target("lrs/lr-0.001", sweep.parent).state.path == sweep / "lr-0.001"
    out = jobgen("status", "lrs", "--watch", env={"JOBGEN_RUNS_ROOT": str(sweep.parent)})
    assert out.returncode != 0 and "lrs/POINT" in out.stderr, out.stderr
