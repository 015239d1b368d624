"""jobgen.report.plot: what it reads from a run directory, and its message without matplotlib.
(tests/distributed/test_tracking.py draws a real run that resumed twice.)"""

from __future__ import annotations

import datetime as dt
import json

from helpers import jobgen
from jobgen.report.plot import read_plot_data
from jobgen.runs.rundir import RunDir

T0 = 1_800_000_000


def lay_out(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "demo")
    (run.path / "logs").mkdir(parents=True)
    (run.path / "spec.json").write_text("{}")
    submitted = dt.datetime.fromtimestamp(T0 - 100, dt.timezone.utc).isoformat()
    run.jobs_file.write_text(json.dumps([{"job_id": 5, "array": 2, "submitted_at": submitted}]))
    lines = [
        {"time": T0 + 10 * s, "step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens_per_s": 500.0, "job_id": "6"}
        for s in range(1, 9)
    ] + [
        {"time": T0 + 400 + 10 * s, "step": s, "loss": 4.0, "lr": 1e-3, "tokens_per_s": 480.0, "job_id": "7"}
        for s in range(6, 12)
    ]
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    tasks = [
        {"event": "first_step", "job_id": "6", "time": T0 + 10, "job_start": T0 - 20, "start_step": 0},
        {"event": "first_step", "job_id": "7", "time": T0 + 460, "job_start": T0 + 430, "start_step": 5},
    ]
    (run.path / "tasks.jsonl").write_text("".join(json.dumps(x) + "\n" for x in tasks))
    # Job 6 has the batch script's end record; job 7 is still running (no record yet).
    run.task_record(6, 0).write_text(json.dumps({"job_id": "6", "restart": 0, "job_start": T0 - 20, "end": T0 + 95}))
    return run


def test_resumes_and_the_time_without_a_running_job(tmp_path):
    data = read_plot_data(lay_out(tmp_path))
    assert data.resumes == [(5, T0 + 460)]  # the first job started at step 0: no resume
    # Queued from submission to the first start, then between job 6's end and job 7's start.
    assert data.waits == [(T0 - 100, T0 - 20), (T0 + 95, T0 + 430)]
    assert data.metrics["loss"].steps[-1] == 11 and len(data.metrics["tokens_per_s"].values) == 14


def test_without_matplotlib_the_message_says_what_to_install(tmp_path):
    run = lay_out(tmp_path)
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed here')\n")
    proc = jobgen("plot", str(run.path), env={"PYTHONPATH": str(blocker.parent)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "pip install 'jobgen[plot]'" in proc.stderr
    assert not (run.path / "plot.png").exists()


def test_a_trainers_loss_and_learning_rate_without_throughput(tmp_path):
    """What JobgenCallback records (loss, lr, grad_norm on logging steps; no tokens): loss and
    learning rate are drawn, and the throughput panel says it is unknown."""
    from jobgen.report.plot import empty_panels

    run = lay_out(tmp_path)
    lines = [
        {"time": T0 + s, "step": s, "job_id": "6", "restart": 0, "step_seconds": 0.5,
         **({"loss": 3.0 - s / 100, "lr": 5e-5, "grad_norm": 1.1} if s % 5 == 0 else {})}
        for s in range(1, 21)
    ]  # fmt: skip
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = read_plot_data(run)
    assert data.metrics["loss"].steps == [5, 10, 15, 20] and data.metrics["lr"].values == [5e-5] * 4
    assert "throughput unknown" in empty_panels(data)["tokens_per_s"] and set(empty_panels(data)) == {"tokens_per_s"}
    # Tokens per step and step time, where a program logs those instead of tokens/s.
    (run.path / "metrics.jsonl").write_text(json.dumps({**lines[4], "step_tokens": 2048}) + "\n")
    assert read_plot_data(run).metrics["tokens_per_s"].values == [4096.0]


def test_a_trainer_without_the_callback_is_drawn_from_its_trainer_state(tmp_path):
    """The script unchanged: no metrics.jsonl, but the Trainer's checkpoint keeps its history."""
    run = lay_out(tmp_path)
    (run.path / "metrics.jsonl").unlink()
    history = [
        {"step": s, "loss": 3.0 - s / 100, "learning_rate": 5e-5, "grad_norm": 1.0, "epoch": 0.1} for s in (10, 20)
    ]
    for step, cut in ((20, False), (30, True)):  # checkpoint-30 was cut short by the kill
        saved = run.checkpoints / f"checkpoint-{step}"
        saved.mkdir(parents=True)
        if not cut:
            (saved / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    data = read_plot_data(run)
    assert data.metrics["loss"].steps == [10, 20] and data.metrics["lr"].values == [5e-5, 5e-5]
