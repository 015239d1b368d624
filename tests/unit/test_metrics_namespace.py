"""A user's metrics never replace the fields jobgen writes into ``metrics.jsonl`` (time,
job_id, restart, step, step_seconds, event), which status, plot, goodput and the hang
watchdog trust: a colliding name is kept as ``user/<name>``; every other name, and the
Hugging Face Trainer's logs, go through as they are."""

from __future__ import annotations

import time
from pathlib import Path

from jobgen.runs.jsonl_records import read_jsonl, training_lines
from jobgen.runtime import Job, lifecycle
from jobgen.runtime.records import MetricsWriter
from run_dirs import command_run, job_environ


def test_colliding_user_metrics_are_prefixed_and_the_system_fields_win(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # MetricsWriter stamps from the process's environment
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    run = command_run(tmp_path)
    before = time.time()
    with lifecycle(start_step=0, job=Job(run.path, job_environ())) as life:
        life.step_done(
            1,
            loss=2.0,
            tokens_per_s=1234.0,  # a user's program may report it for status: not a system field
            time=5.0,
            job_id=9,
            restart=3,
            step_seconds=999.0,
            event=1,
        )
    (line,) = read_jsonl(run.path / "metrics.jsonl")
    assert line["time"] >= before and line["job_id"] == "77" and line["restart"] == 0
    assert line["step"] == 1 and line["step_seconds"] < 60
    assert "event" not in line and training_lines([line]) == [line]  # not taken for an evaluation
    assert line["loss"] == 2.0 and line["tokens_per_s"] == 1234.0
    assert {k: line[k] for k in line if k.startswith("user/")} == {
        "user/time": 5.0,
        "user/job_id": 9.0,
        "user/restart": 3.0,
        "user/step_seconds": 999.0,
        "user/event": 1.0,
    }


def test_the_writers_stamp_wins_over_any_record(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.log_step({"step": 3, "time": 1.0, "job_id": "other", "restart": 9, "loss": 1.5})
    (line,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert line["time"] > 1.0 and line["job_id"] == "77" and line["restart"] == 2
    assert line["step"] == 3 and line["loss"] == 1.5


def test_the_hf_trainers_logs_keep_their_names(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    from transformers import TrainerControl, TrainerState

    from jobgen.runtime.hf import JobgenCallback

    run = command_run(tmp_path)
    callback = JobgenCallback(Job(run.path, job_environ()))
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(None, state, control)
    state.global_step = 1
    logs = {"loss": 2.5, "learning_rate": 1e-3, "grad_norm": 0.7, "epoch": 0.01, "time": 5.0, "step": 99}
    callback.on_log(None, state, control, logs=logs)
    callback.on_step_end(None, state, control)
    (line,) = read_jsonl(run.path / "metrics.jsonl")
    assert line["loss"] == 2.5 and line["lr"] == 1e-3 and line["grad_norm"] == 0.7
    assert line["step"] == 1 and line["job_id"] == "77" and abs(line["time"] - time.time()) < 60
