"""Lost work, goodput and lead time from the records the trainer leaves in the run directory."""

import json

import pytest

from jobgen.runs.goodput import goodput, lead_time_warning, required_lead_seconds, run_reports, task_reports

T0 = 1_800_000_000.0


def metrics_lines(job: str, steps: range, start_time: float, step_seconds: float = 1.0) -> list[dict]:
    return [
        {
            "job_id": job,
            "step": s,
            "loss": 1.0,
            "step_seconds": step_seconds,
            "time": start_time + (s - steps.start + 1) * step_seconds,
        }
        for s in steps
    ]


TASKS = [
    # A: steps 1-30, stopped by the kill switch with a checkpoint at 30. Every record has its time
    # (MetricsWriter.log_task writes it; a line without one is no record, test_bad_files.py).
    {
        "event": "first_step",
        "job_id": "11",
        "start_step": 0,
        "seconds_to_first_step": 8.0,
        "job_start": T0,
        "time": T0 + 8,
    },
    {
        "event": "exit",
        "job_id": "11",
        "start_step": 0,
        "end_step": 30,
        "exit_code": 10,
        "exit_reason": "kill switch",
        "step_seconds_total": 30.0,
        "step_seconds_max": 1.2,
        "save_seconds": [0.5, 2.0],
        "job_start": T0,
        "time": T0 + 40,
    },
    # B: resumed at 30, SIGKILLed at 47 (last checkpoint 40): no exit record.
    {
        "event": "first_step",
        "job_id": "12",
        "start_step": 30,
        "seconds_to_first_step": 9.0,
        "job_start": T0 + 100,
        "time": T0 + 109,
    },
    # C: resumed at 40, finished at 60.
    {
        "event": "first_step",
        "job_id": "13",
        "start_step": 40,
        "seconds_to_first_step": 7.5,
        "job_start": T0 + 200,
        "time": T0 + 207.5,
    },
    {
        "event": "exit",
        "job_id": "13",
        "start_step": 40,
        "end_step": 60,
        "exit_code": 0,
        "exit_reason": "finished",
        "step_seconds_total": 20.0,
        "step_seconds_max": 1.0,
        "save_seconds": [0.4],
        "job_start": T0 + 200,
        "time": T0 + 230,
    },
]
METRICS = (
    metrics_lines("11", range(1, 31), T0 + 8)
    + metrics_lines("12", range(31, 48), T0 + 109)
    + metrics_lines("13", range(41, 61), T0 + 207.5)
)


def test_recomputed_steps_and_end_steps():
    reports = task_reports(TASKS, METRICS)
    assert [(r.job_id, r.start_step, r.end_step, r.recomputed_steps) for r in reports] == [
        ("11", 0, 30, 0),
        ("12", 30, 47, 0),
        ("13", 40, 60, 7),
    ]
    assert reports[1].exit_reason.startswith("ended without an exit record")
    assert reports[0].seconds_to_first_step == 8.0 and reports[0].allocated_seconds == 40.0


def test_goodput_counts_only_kept_steps():
    reports = task_reports(TASKS, METRICS)
    # A kept all 30 s of steps; B kept 10 of its 17 steps; C kept all 20 s.
    assert reports[0].useful_seconds == 30.0
    assert reports[1].useful_seconds == pytest.approx(10.0)
    assert reports[2].useful_seconds == 20.0
    allocated = 40.0 + (T0 + 109 + 17 - (T0 + 100)) + 30.0
    assert goodput(reports) == pytest.approx((30 + 10 + 20) / allocated, abs=1e-4)


def test_a_killed_job_held_its_allocation_until_its_time_limit_or_the_next_job():
    """Killed outright (a time limit without graceful_stop, SIGKILL), a job leaves no exit
    record: its last metrics line would understate what it held."""
    # B (killed, started at T0+100) is followed by C at T0+200: with a 60 s limit it held 60 s,
    # with a 1 h limit until C started.
    short = task_reports(TASKS, METRICS, time_limit=60)
    assert short[1].allocated_seconds == 60.0
    assert task_reports(TASKS, METRICS, time_limit=3600)[1].allocated_seconds == 100.0
    # Jobs that exited keep what their exit record says.
    assert short[0].allocated_seconds == 40.0 and short[2].allocated_seconds == 30.0
    # Never less than its last metrics line showed.
    assert task_reports(TASKS, METRICS, time_limit=10)[1].allocated_seconds == pytest.approx(26.0)


def test_a_killed_last_job_keeps_only_its_saved_steps():
    tasks = TASKS[:3]  # A, then B killed at 47 with its last checkpoint at 40, and nothing after
    metrics = METRICS[:47]
    (_, killed) = task_reports(tasks, metrics, time_limit=3600, now=T0 + 160, saved_step=40)
    assert killed.useful_seconds == pytest.approx(10.0)  # steps 31-40 of its 17
    assert killed.allocated_seconds == 60.0  # still holding it "now", or killed by then
    (_, unsaved) = task_reports(tasks, metrics)
    assert unsaved.useful_seconds == pytest.approx(17.0)  # what the records alone would claim


def test_lead_time_warning():
    reports = task_reports(TASKS, METRICS)
    needed = required_lead_seconds(reports)
    assert needed == pytest.approx(2.0 * (2.0 + 1.2) + 10.0)
    assert lead_time_warning(int(needed) + 1, reports) is None
    warning = lead_time_warning(10, reports)
    assert "slowest save took 2.0s" in warning and "at least 16s" in warning
    assert required_lead_seconds([]) is None


def test_reads_the_run_directory_and_skips_a_cut_line(tmp_path):
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS) + '{"event": "exi')
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    assert [r.job_id for r in run_reports(tmp_path)] == ["11", "12", "13"]
    assert run_reports(tmp_path / "nothing") == []
