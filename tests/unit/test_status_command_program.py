"""`jobgen status` for a program jobgen did not write (issue 22): a Hugging Face Trainer script
run as ``program = "command"`` on 2 nodes, 2-minute tasks, array 4.

The run directory is built by hand as the batch script, jobgen.runtime.hf.JobgenCallback and
the Trainer leave it; Slurm's answers are captured `scontrol show job --oneliner` text fed to
the real parsers (tests/unit/test_task_table.py has the dev cluster's capture this follows).
"""

from __future__ import annotations

import json

import pytest

from helpers import jobgen
from jobgen.cli.status import _statuses
from jobgen.report.status import run_status
from jobgen.report.status_format import format_listing, format_status
from jobgen.report.stop_requests import remove
from jobgen.report.task_table import TIME_LIMIT_KILLED
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm
from jobgen.spec.loader import resolve
from run_dirs import batch_end_record

T0 = 1_800_000_000
LIMIT = 120
CRASHED = "crashed (see the traceback in the log)"  # what the batch script records for torchrun's 1


def clm_run(tmp_path) -> RunDir:
    """run_clm.py as `program = "command"`: time 2m, array 4 (job 11, tasks 12..15)."""
    script = tmp_path / "run_clm.py"
    script.write_text("print('hi')\n")
    job = {"name": "clm", "program": "command", "time": "2m", "exit_grace": "30s", "runs_root": str(tmp_path)}
    spec = resolve({"site": "local", "job": job, "command": {"script": str(script)}}, spec_file=None, base_dir=tmp_path)
    run = RunDir(tmp_path / "clm")
    for sub in ("switches", "logs", "checkpoints"):
        (run.path / sub).mkdir(parents=True)
    run.spec_file.write_text(json.dumps(spec.to_json()))
    run.record_job({"job_id": 11, "array": 4})
    return run


def batch_record(run: RunDir, job: int, task: int, code, slurm_exit, reason: str, start: float, end):
    """logs/task.<job>.0.json as the batch script's finish writes it."""
    batch_end_record(run, job, task, code, slurm_exit, reason, array=11, start=start, end=end)


def append(path, records):
    with path.open("a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


def callback_records(run: RunDir, job: int, task: int, start_step: int, end_step: int, start: float):
    """What JobgenCallback (jobgen.runtime.Life) leaves for one task that stopped at its
    lead-time signal: first_step and exit records, a metrics line per step (loss, lr and
    grad_norm on the Trainer's logging steps, no tokens), and the Trainer's checkpoint."""
    ids = {"job_id": str(job), "restart": 0, "array_job_id": "11", "array_task": str(task)}
    append(run.path / "tasks.jsonl", [
        {**ids, "time": start + 20, "event": "first_step", "step": start_step + 1, "start_step": start_step,
         "job_start": start, "seconds_to_first_step": 20.0},
        {**ids, "time": start + 95, "event": "exit", "start_step": start_step, "end_step": end_step,
         "job_start": start, "exit_code": 12, "exit_reason": "time limit (USR1 30 s before the limit)",
         "step_seconds_total": 70.0, "step_seconds_max": 1.0, "save_seconds": [2.0]},
    ])  # fmt: skip
    append(run.path / "metrics.jsonl", [
        {"time": start + 20 + s - start_step, "job_id": str(job), "restart": 0, "step": s, "step_seconds": 0.5,
         **({"loss": 3.0 - s / 1000, "lr": 5e-5, "grad_norm": 1.2} if s % 10 == 0 else {})}
        for s in range(start_step + 1, end_step + 1)
    ])  # fmt: skip
    saved = run.checkpoints / f"checkpoint-{end_step}"
    saved.mkdir()
    (saved / "trainer_state.json").write_text(json.dumps({"global_step": end_step, "log_history": []}))
    batch_record(run, job, task, 12, 0, "time limit (USR1 30 s before the limit): saving and exiting", start,
                 start + 96)  # fmt: skip


# `scontrol show job --oneliner 11` within MinJobAge: the last task (job 15) killed at its limit,
# shaped as the dev cluster's capture in tests/unit/test_task_table.py.
SCONTROL_TIMEOUT = (
    "JobId=15 ArrayJobId=11 ArrayTaskId=4 ArrayTaskThrottle=1 JobName=clm UserId=root(0) GroupId=root(0) "
    "MCS_label=N/A Priority=4294901757 Nice=0 Account=(null) QOS=(null) JobState=TIMEOUT Reason=TimeLimit "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:02:01 "
    "TimeLimit=00:02:00 TimeMin=N/A SubmitTime=2026-11-22T14:20:40 EligibleTime=2026-11-22T14:20:41 "
    "StartTime=2026-11-22T14:26:41 EndTime=2026-11-22T14:28:42 Partition=debug NodeList=node[1-2] "
    "BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 WorkDir=/tmp Power=\n"
)


def four_tasks(tmp_path) -> RunDir:
    """Tasks 1-3 stopped at their lead-time signal (callback records, 100 steps each); task 4
    ran past it (its signal came during a long save) and was killed at the limit: no exit
    record of the program, the batch script's record says what torchrun's status means."""
    run = clm_run(tmp_path)
    for i, job in enumerate((12, 13, 14)):
        callback_records(run, job, i + 1, 100 * i, 100 * (i + 1), T0 + 200 * i)
    batch_record(run, 15, 4, 1, 1, CRASHED, T0 + 600, T0 + 600 + LIMIT + 3)
    return run


@pytest.fixture
def slurm_remembers_the_timeout(monkeypatch):
    monkeypatch.setattr(slurm, "queue", lambda job_ids=None: [])
    monkeypatch.setattr(slurm, "config", lambda: {"MinJobAge": "3000000000", "KillWait": "30"})
    monkeypatch.setattr(slurm, "partitions", lambda: [])
    monkeypatch.setattr(slurm, "show_job", lambda job_id: slurm.parse_records(SCONTROL_TIMEOUT))


def test_a_task_killed_at_its_time_limit_is_timeout_not_a_crash(tmp_path, monkeypatch):
    run = four_tasks(tmp_path)
    # Slurm has forgotten every task (MinJobAge, no accounting): the run directory decides.
    monkeypatch.setattr(slurm, "show_job", lambda job_id: [])
    monkeypatch.setattr(slurm, "config", lambda: {})
    monkeypatch.setattr(slurm, "queue", lambda job_ids=None: [])
    status = run_status(run)
    last = status.tasks[-1]
    assert (last.slurm_id, last.state, last.exit_reason, last.jobgen_exit) == (
        "11_4",
        "TIMEOUT",
        TIME_LIMIT_KILLED,
        None,
    )
    assert [t.state for t in status.tasks] == ["COMPLETED"] * 3 + ["TIMEOUT"]
    assert status.state == "stopped"
    assert CRASHED not in format_status(status)
    row = status.to_json()["tasks"][-1]
    assert row["state"] == "TIMEOUT" and row["exit_reason"] == TIME_LIMIT_KILLED


def test_slurms_timeout_wins_over_the_crash_the_batch_script_recorded(tmp_path, slurm_remembers_the_timeout):
    run = four_tasks(tmp_path)
    # Recorded 100 s short of the limit (the script's clock started late): only Slurm can tell.
    batch_record(run, 15, 4, 1, 1, CRASHED, T0 + 600, T0 + 620)
    last = run_status(run).tasks[-1]
    assert (last.state, last.exit_reason, last.exit_code) == ("TIMEOUT", TIME_LIMIT_KILLED, "0:15")


def test_a_crash_before_the_limit_stays_a_crash(tmp_path, monkeypatch):
    run = four_tasks(tmp_path)
    batch_record(run, 15, 4, 1, 1, CRASHED, T0 + 600, T0 + 640)
    monkeypatch.setattr(slurm, "queue", lambda job_ids=None: [])
    status = run_status(run, details=False)
    assert (status.tasks[-1].state, status.tasks[-1].exit_reason, status.state) == ("FAILED", CRASHED, "failed")


def _listing_row(text: str) -> dict[str, str]:
    header, row = text.splitlines()[:2]
    return dict(zip(header.split(), row.split()))


def test_the_listing_and_one_runs_view_agree_on_state_and_step(tmp_path, slurm_remembers_the_timeout):
    run = four_tasks(tmp_path)
    # Recorded short of the limit: the state comes from Slurm, which the listing must ask too.
    batch_record(run, 15, 4, 1, 1, CRASHED, T0 + 600, T0 + 620)
    (listed,) = _statuses([run], {run: None}, lambda spec: [], details=False)
    (one,) = _statuses([run], {run: None}, lambda spec: [], details=True)
    assert (listed.state, listed.step) == (one.state, one.step) == ("stopped", 300)
    assert one.last_checkpoint == "checkpoint-300"
    row = _listing_row(format_listing([listed]))
    detail = dict(line.split(None, 1) for line in format_status(one).splitlines() if line[:5] in ("state", "step "))
    assert (row["STATE"], row["STEP"]) == (detail["state"], detail["step"].split()[0]) == ("stopped", "300")


def test_stop_requests_of_ended_attempts_are_no_switches_and_are_removed(tmp_path, monkeypatch):
    run = four_tasks(tmp_path)
    for name in ("stop.12.0", "stop.15.0", "stop.16.0", "stop.17.0", "stop.13", "kill"):
        (run.switches / name).write_text("USR1\n")
    monkeypatch.setattr(slurm, "queue", lambda job_ids=None: slurm.parse_squeue(QUEUE))
    monkeypatch.setattr(slurm, "config", lambda: {})
    monkeypatch.setattr(slurm, "show_job", lambda job_id: slurm.parse_records(SCONTROL_TIMEOUT))
    run.record_job({"job_id": 16, "array": 1})  # a later submission, running now
    run.record_job({"job_id": 17, "array": 1})  # one that Slurm forgot and that left no end record
    batch_record(run, 17, 1, None, None, "", T0 + 900, None)
    status = run_status(run)
    # 12: the program's exit record; 15: the batch script's end record (and Slurm's TIMEOUT);
    # 13: the stem of a job that has ended. 16 runs; 17 ended by no record: kept.
    assert status.switches == ["kill", "stop.16.0", "stop.17.0"]
    assert sorted(p.rsplit("/", 1)[1] for p in status.stale_stop_requests) == ["stop.12.0", "stop.13", "stop.15.0"]
    assert "stale_stop_requests" not in status.to_json()
    assert remove([run.switches / "stop.12.0", run.switches / "gone"]) == [run.switches / "stop.12.0"]


QUEUE = "16\x1f16\x1f1\x1fRUNNING\x1fNone\x1f0:30\x1f2:00\x1fnode[1-2]\x1f2026-11-22T14:30:00\x1fclm\n"


def test_jobgen_stop_and_status_clear_stale_stop_requests(tmp_path):
    run = four_tasks(tmp_path)
    (run.switches / "stop.12.0").write_text("USR1\n")
    (run.switches / "stop.99.0").write_text("USR1\n")  # an attempt no record shows ended
    jobgen("stop", str(run.path), check=True)
    assert sorted(p.name for p in run.switches.iterdir()) == ["kill", "stop.99.0"]
    (run.switches / "stop.13.0").write_text("TERM\n")
    proc = jobgen("status", str(run.path), "--json")  # no Slurm here: the records decide
    assert "stop.13.0" not in json.loads(proc.stdout)["switches"], proc.stdout
    assert not (run.switches / "stop.13.0").exists() and (run.switches / "stop.99.0").exists()
