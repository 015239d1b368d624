"""Relaunches inside one array task (issue 35, job.in_job_restarts): where the count comes
from, which exit codes a relaunch may get past, how a crash that repeats across launches is
told from one that does not, and how a task's launches read in status and goodput. The batch
script's loop itself runs on the dev cluster (tests/cluster/test_slurm_in_job_restarts.py)."""

from __future__ import annotations

import json

import pytest

from helpers import DATA, run_spec, script_supervisor
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.render import render
from jobgen.report.status_format import task_lines
from jobgen.report.stop_requests import ended_attempts
from jobgen.report.task_table import build_tasks, read_task_records
from jobgen.runs.goodput import task_reports
from jobgen.runs.quarantine import RankEnd, read_rank_ends
from jobgen.runs.rundir import RunDir
from jobgen.runtime.records import CrashSignature, attempt_ended, attempt_started
from jobgen.spec.loader import SpecError, load_run
from run_dirs import batch_end_record

T0 = 1_800_000_000.0
CRASH = CrashSignature("builtins.RuntimeError", "loop.py:10 in step", 7)


def spec_with(tmp_path, model, site, **job):
    base = {"nodes": 2, "time": "1h", "runs_root": str(tmp_path / "runs"), **job}
    return run_spec(tmp_path, "r", site=site, job=base, model={"path": str(model)}, data={"path": str(DATA)})


@pytest.mark.parametrize(
    ("site", "job", "expected"),
    [
        ("local", {}, 0),  # the dev cluster's CPU site: the task-to-task path its tests exercise
        ("local-gpu", {}, 0),  # GPUs scheduled, computation on the CPU: as the dev site
        ({"profile": "local", "slurm": {"gpus_per_node": 4}}, {}, 2),  # a GPU site
        ({"profile": "local", "slurm": {"gpus_per_node": 4, "in_job_restarts": 5}}, {}, 5),
        ({"profile": "local", "slurm": {"gpus_per_node": 4}}, {"in_job_restarts": 0}, 0),
        ("local", {"in_job_restarts": 3}, 3),
    ],
)
def test_the_count_is_the_jobs_else_the_sites_else_by_the_kind_of_site(tmp_path, tiny_model, site, job, expected):
    spec = load_run(spec_with(tmp_path, tiny_model, site, **job))
    assert spec.in_job_restarts == expected
    assert script_supervisor(render(spec))["in_job_restarts"] == expected


def test_a_program_that_is_not_relaunched_refuses_the_key(tmp_path):
    spec = run_spec(tmp_path, "d", job={"program": "doctor", "nodes": 2, "time": "1h", "in_job_restarts": 1})
    with pytest.raises(SpecError, match=r"job\.in_job_restarts = 1: program 'doctor' is not relaunched"):
        load_run(spec)


def test_only_a_crash_or_a_hang_is_a_failure_a_relaunch_can_get_past():
    assert [code for code in ExitCode if code.relaunches] == [ExitCode.CRASHED, ExitCode.HUNG]
    assert not ExitCode.HUNG.planned and not ExitCode.HUNG.repeats


def test_the_same_crash_in_the_next_launch_repeats_and_a_requeue_starts_afresh(tmp_path):
    run = RunDir(tmp_path)
    (run.path / "logs").mkdir()
    attempt_started(run, "41", 0, "40", launch=0)
    assert attempt_ended(run, "41", 0, "40", CRASH, launch=0) is None  # one crash proves nothing
    attempt_started(run, "41", 0, "40", launch=1)
    assert attempt_ended(run, "41", 0, "40", CRASH, launch=1) == CRASH  # the relaunch met it again
    # Slurm requeued the job (restart 1): an earlier attempt of the same job is not evidence.
    attempt_started(run, "41", 1, "40", launch=0)
    assert attempt_ended(run, "41", 1, "40", CRASH, launch=0) is None
    # Another crash after a relaunch is no repeat.
    attempt_started(run, "41", 1, "40", launch=1)
    other = CrashSignature("builtins.KeyError", "loop.py:10 in step", 7)
    assert attempt_ended(run, "41", 1, "40", other, launch=1) is None


def test_an_attempt_record_from_before_launches_counts_as_the_first_launch(tmp_path):
    run = RunDir(tmp_path)
    (run.path / "logs").mkdir()
    old = {
        "job_id": "41",
        "restart": 0,
        "array_job_id": "40",
        "ended": True,
        "crash": json.loads(json.dumps(CRASH.__dict__)),
    }
    (run.path / "logs" / "attempt.json").write_text(json.dumps(old))
    attempt_started(run, "41", 0, "40", launch=1)
    assert attempt_ended(run, "41", 0, "40", CRASH, launch=1) == CRASH


def launch_records(launch, start_step, end_step, code, *, job_start, first_step_after=20.0, end=None):
    ids = {"job_id": "41", "restart": 0, "array_job_id": "40", "array_task": "1"} | (
        {"launch": launch} if launch else {}
    )
    records = [{**ids, "event": "first_step", "time": job_start + first_step_after, "job_start": job_start,
                "start_step": start_step, "seconds_to_first_step": first_step_after}]  # fmt: skip
    if code is not None:
        records.append({**ids, "event": "exit", "time": end, "job_start": job_start, "start_step": start_step,
                        "end_step": end_step, "exit_code": code, "exit_reason": f"exit {code}"})  # fmt: skip
    return records


def metrics(launch, steps, start):
    stamp = {"job_id": "41", "restart": 0} | ({"launch": launch} if launch else {})
    return [{**stamp, "step": s, "loss": 1.0, "step_seconds": 1.0, "time": start + i + 1} for i, s in enumerate(steps)]


def test_a_task_relaunched_once_is_one_row_with_its_relaunch_and_what_it_cost(tmp_path):
    """Launch 0 trained 0 -> 17 and crashed (its checkpoint at 15); the batch script relaunched
    it at T0+60; launch 1 resumed at 15, took its first step 12 s later and is training."""
    run = RunDir(tmp_path / "demo")
    (run.path / "logs").mkdir(parents=True)
    run.record_job({"job_id": 40, "array": 1})
    batch_end_record(run, 41, 1, None, None, "", array=40, start=T0, end=None)
    record = json.loads(run.task_record("41", 0).read_text())
    relaunch = {"launch": 1, "time": T0 + 60, "after_exit": 1, "reason": "crashed: RuntimeError: gloo peer gone"}
    run.task_record("41", 0).write_text(json.dumps({**record, "restarts": [relaunch]}))
    tasks = launch_records(0, 0, 17, 1, job_start=T0, end=T0 + 58) + launch_records(
        1, 15, None, None, job_start=T0 + 60, first_step_after=12.0
    )
    lines = metrics(0, range(1, 18), T0 + 20) + metrics(1, range(16, 19), T0 + 72)
    reports = task_reports(tasks, lines)
    assert [(r.launch, r.start_step, r.end_step, r.recomputed_steps) for r in reports] == [
        (0, 0, 17, 0),
        (1, 15, 18, 2),
    ]
    (row,) = build_tasks(run, "demo", [], [], reports, read_task_records(run), 3600)
    assert (row.start_step, row.end_step, row.recomputed_steps, row.seconds_to_first_step) == (0, 18, 2, 20.0)
    assert row.state == "ENDED" and row.jobgen_exit is None  # launch 0's crash does not end the task
    (again,) = row.relaunches
    assert (again.launch, again.after_exit, again.start_step, again.recomputed_steps) == (1, 1, 15, 2)
    assert again.seconds_to_first_step == 12.0 and again.reason == relaunch["reason"]
    shown = task_lines([row])[-1]
    assert shown.startswith("  relaunch 1 ") and "after exit 1 (crashed: RuntimeError: gloo peer gone)" in shown
    assert shown.endswith(": resumed at step 15, 2 redone, first step 12s after the relaunch"), shown
    # The attempt is going on: its stop request is not stale though launch 0 left an exit record.
    ended, _ = ended_attempts(read_task_records(run), reports)
    assert ("41", 0) not in ended


def test_a_relaunch_the_record_does_not_hold_yet_still_shows(tmp_path):
    """The trainer's first step of launch 1 can come before the batch script's record is
    rewritten (a killed shell never rewrites it): the relaunch is shown from the trainer's side."""
    run = RunDir(tmp_path / "demo")
    (run.path / "logs").mkdir(parents=True)
    tasks = launch_records(0, 0, 9, 1, job_start=T0, end=T0 + 30) + launch_records(
        1, 5, 12, 0, job_start=T0 + 31, end=T0 + 80
    )
    reports = task_reports(tasks, [])
    (row,) = build_tasks(run, "demo", [], [], reports, read_task_records(run), 3600)
    assert [(r.launch, r.after_exit, r.start_step) for r in row.relaunches] == [(1, None, 5)]
    assert (row.jobgen_exit, row.state, row.exit_reason) == (0, "COMPLETED", "exit 0")  # the newest launch says
    assert "relaunch 1  after a failure: resumed at step 5" in task_lines([row])[-1]


def test_each_launch_keeps_its_own_rank_ends(tmp_path):
    """The node check after a failed relaunch reads that launch's rank ends only: the ranks of
    the launch before it ended their own way (nothing from an earlier launch is acted on)."""
    run = RunDir(tmp_path)
    RankEnd(0, "node1", 30.0, "DistBackendError").write(run, "41", 0)
    RankEnd(1, "node2", 0.4, "ValueError").write(run, "41", 0, launch=1)
    assert [e.rank for e in read_rank_ends(run, "41", 0)] == [0]
    assert [e.rank for e in read_rank_ends(run, "41", 0, launch=1)] == [1]
    assert read_rank_ends(run, "41", 0, launch=2) == []
