"""Run directories built by hand, for the tests of what reads them (status, watch, the
runtime a user's program gets, bad files): the spec.json `jobgen submit` would write and
the records a test needs, without rendering, Slurm or a trainer."""

from __future__ import annotations

import json
import time
from pathlib import Path

from helpers import write_spec
from jobgen.runs.rundir import RunDir
from jobgen.spec.loader import load_run, resolve

JOB_HEAD = """
        site = "local"
        [job]
        name = "stat"
        time = "5m"
        exit_grace = "1m"
        runs_root = "runs"
"""


def recorded_run(directory: Path, spec_text: str) -> RunDir:
    """The run of ``spec_text`` (written to ``directory/run.toml``) with only its spec.json."""
    spec = load_run(write_spec(directory, spec_text))
    run = RunDir(spec.run_dir)
    run.path.mkdir(parents=True)
    run.spec_file.write_text(json.dumps(spec.to_json()))
    return run


def unsubmitted_run(directory: Path) -> RunDir:
    """A run directory with only its spec.json: never submitted, nothing recorded yet."""
    return recorded_run(directory, JOB_HEAD + 'program = "doctor"\n')


def training_run_at_step_25(directory: Path) -> RunDir:
    """A training run of 60 steps: its spec.json, a submission of one array task (17_1), and a
    metrics line every 5 steps (log_every_steps) up to step 25."""
    (directory / "model").mkdir()
    (directory / "data.jsonl").write_text('{"text": "a"}\n')
    run = recorded_run(
        directory,
        JOB_HEAD
        + """
        program = "train"
        [model]
        path = "model"
        [data]
        path = "data.jsonl"
        [train]
        max_steps = 60
    """,
    )
    (run.path / "logs").mkdir()
    run.record_job({"job_id": 17, "array": 1})
    lines = [{"time": 1000.0 + s, "step": s, "loss": 3.0 - s / 100, "step_seconds": 1.0} for s in (5, 10, 20, 25)]
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def command_run(directory: Path, grace: str = "1m") -> RunDir:
    """A `program = "command"` run (its script prints "hi") with its switches/, logs/ and
    checkpoints/, as the runtime a user's program imports finds it."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "train.py"
    script.write_text("print('hi')\n")
    job = {"name": "own", "program": "command", "time": "1h", "exit_grace": grace, "runs_root": str(directory)}
    spec = resolve(
        {"site": "local", "job": job, "command": {"script": str(script)}}, spec_file=None, base_dir=directory
    )
    run = RunDir(directory / "own")
    for sub in ("switches", "logs", "checkpoints"):
        (run.path / sub).mkdir(parents=True)
    run.spec_file.write_text(json.dumps(spec.to_json()))
    return run


def job_environ(end_in: float = 3600.0, rank: int = 0) -> dict[str, str]:
    """The environment the batch script gives a rank of job 77: its end ``end_in`` s from now."""
    return {
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": "0",
        "RANK": str(rank),
        "WORLD_SIZE": "1",
        "JOBGEN_JOB_END_TIME": str(int(time.time() + end_in)),
        "JOBGEN_JOB_START": str(time.time() - 5),
    }


def batch_end_record(
    run: RunDir,
    job_id: int,
    task: int,
    code: int | None,
    slurm_exit: int | None,
    reason: str,
    *,
    array: int = 5,
    restart: int = 0,
    start: float,
    end: float | None,
) -> None:
    """``logs/task.<job>.<restart>.json`` as the batch script's ``finish`` writes it (codes None:
    started, not ended yet)."""
    record = {
        "job_id": str(job_id),
        "array_job_id": str(array),
        "array_task": str(task),
        "restart": restart,
        "nodes": "node[1-2]",
        "job_start": start,
        "end": end,
        "exit_code": code,
        "slurm_exit": slurm_exit,
        "reason": reason,
    }
    run.task_record(job_id, restart).write_text(json.dumps(record))
