"""jobgen.plot: what it reads from a run directory, and its message without matplotlib.
(tests/distributed/test_tracking.py draws a real run that resumed twice.)"""

from __future__ import annotations

import datetime as dt
import json

from helpers import jobgen
from jobgen.plot import read_plot_data
from jobgen.rundir import RunDir

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
