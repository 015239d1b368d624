"""A runs root with one of every file jobgen reads, each valid, for tests/unit/test_damaged_files.py
to damage one at a time: a training run (every record a run of the bundled trainer leaves, a
server's records), a run of the user's own program (a Hugging Face Trainer's checkpoint, a
task's command plan) and a sweep of two points (its index and claims). Spec files, jobs.json
and the sweep's files are written by jobgen's own submission (sbatch replaced); the records a
job leaves are written as the trainer, the batch script and the sweep's claim write them.

:meth:`World.reset` puts the world back after a case: every file as it was, nothing added.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import run_spec, small_sweep
from jobgen.runs.rundir import RunDir
from jobgen.runs.sweep_files import POINTS_DIR
from jobgen.slurm import client as slurm
from jobgen.spec.loader import load_run

NOW = time.time()
JOB = 17


@dataclass
class World:
    root: Path
    runs: Path
    solo: RunDir  # a training run of the bundled trainer, with [eval] and a server's records
    own: RunDir  # program = "command": a Hugging Face Trainer's checkpoint, a command plan
    sweep: Path  # a sweep of two points
    point: RunDir  # its first point
    elsewhere: Path  # outside the runs root: what links lead to, outputs
    files: dict[Path, bytes] = field(default_factory=dict)
    dirs: set[Path] = field(default_factory=set)
    stats: dict[Path, tuple | None] = field(default_factory=dict)

    def snapshot(self) -> None:
        self.files = {p: p.read_bytes() for p in self.runs.rglob("*") if p.is_file() and not p.is_symlink()}
        self.dirs = {p for p in self.runs.rglob("*") if p.is_dir() and not p.is_symlink()}
        self.stats = {p: _stamp(p) for p in self.files}

    def clear_switches(self) -> None:
        """The switches a command set (stop, save, abort: of a run or of a sweep's points) removed."""
        for path in self.runs.glob("**/switches/*"):
            if path not in self.files:
                path.unlink()

    def reset(self) -> None:
        """Every file of the snapshot back as it was; anything else under the runs root gone."""
        for path in sorted(self.runs.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path in self.dirs and path.is_dir() and not path.is_symlink():
                continue
            if path in self.files and _stamp(path) == self.stats[path]:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        for path in sorted(self.dirs):
            path.mkdir(exist_ok=True)
        for path, content in self.files.items():
            if not os.path.lexists(path):
                path.write_bytes(content)
                self.stats[path] = _stamp(path)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells a file changed: its inode, size and time (None for anything but a file)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return (info.st_ino, info.st_size, info.st_mtime_ns) if stat.S_ISREG(info.st_mode) else None


@contextmanager
def slurm_answers_nothing() -> Iterator[list[list[str]]]:
    """Slurm replaced for the whole module: sbatch gives job ids 17, 18, ...; the queue, its
    configuration and its memory of ended jobs are empty; any other call finds no Slurm."""
    submitted: list[list[str]] = []

    def sbatch(script, options):
        submitted.append([str(script), *options])
        return JOB + len(submitted) - 1

    def no_slurm(args, **_):
        raise slurm.SlurmUnavailable(args, 127, f"{args[0]}: no Slurm in the unit tests")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slurm, "sbatch", sbatch)
        patch.setattr(slurm, "queue", lambda job_ids=None: [])
        patch.setattr(slurm, "queue_named", lambda name: [])
        patch.setattr(slurm, "config", lambda: {})
        patch.setattr(slurm, "show_job", lambda job_id: [])
        patch.setattr(slurm, "ended_jobs", lambda job_ids, accounting: [])
        patch.setattr(slurm, "run", no_slurm)
        yield submitted


def _lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _submit(spec_file: Path) -> RunDir:
    from jobgen.launch.submit import submit

    spec = load_run(str(spec_file))
    submit(spec, source_text=spec_file.read_text(), skip_preflight=True, ignore_memory_plan=True)
    return RunDir(spec.run_dir)


def _training_records(run: RunDir) -> None:
    """What a job of the bundled trainer leaves: metrics, task records, checkpoints, the best
    one, samples, a quarantined node, the batch script's record, logs and a rank map."""
    base = {"job_id": str(JOB), "restart": 0}
    metrics = [{**base, "time": NOW - 100 + s, "step": s, "loss": 3.0 - s / 10, "lr": 1e-4, "tokens_per_s": 900.0,
                "step_seconds": 1.0} for s in (5, 10, 15, 20)]  # fmt: skip
    metrics += [
        {**base, "time": NOW - 90 + s, "step": s, "event": "eval", "eval_loss": 2.5 - s / 100} for s in (10, 20)
    ]
    _lines(run.path / "metrics.jsonl", metrics)
    task = {**base, "array_job_id": str(JOB), "array_task": "1", "job_start": NOW - 200}
    _lines(
        run.path / "tasks.jsonl",
        [
            {**task, "time": NOW - 95, "event": "first_step", "step": 1, "start_step": 0, "seconds_to_first_step": 5.0,
             "world_size": 2, "global_batch": 8},
            {**task, "time": NOW - 50, "event": "exit", "start_step": 0, "end_step": 20, "exit_code": 12,
             "exit_reason": "time limit (USR1 90 s before the limit)", "step_seconds_total": 20.0,
             "step_seconds_max": 1.5, "save_seconds": [2.0], "world_size": 2, "global_batch": 8},
        ],
    )  # fmt: skip
    for step in (10, 20):
        saved = run.checkpoints / f"step-{step:08d}"
        saved.mkdir(parents=True)
        (saved / "trainer_state.json").write_text(json.dumps({"step": step}))
    best = {"step": 20, "checkpoint": "step-00000020", "eval_loss": 2.3, "time": NOW - 60}
    run.best_checkpoint.write_text(json.dumps(best))
    _lines(run.samples, [{"step": s, "prompt": "Say hi", "completion": f"hi at {s}"} for s in (10, 20)])
    quarantined = {"since": NOW - 300, "job": f"{JOB}_1", "reason": "its rank 1 went silent"}
    run.quarantine.write_text(json.dumps({"nodes": {"node3": quarantined}}))
    record = {"job_id": str(JOB), "array_job_id": str(JOB), "array_task": "1", "restart": 0, "nodes": "node[1-2]",
              "job_start": NOW - 200, "end": NOW - 45, "exit_code": 12, "slurm_exit": 0,
              "reason": "time limit (USR1 90 s before the limit): saving and exiting"}  # fmt: skip
    run.task_record(JOB, 0).write_text(json.dumps(record))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW - 150))
    run.batch_log(run.path.name, JOB).write_text(f"{stamp} jobgen: starting task 1\n")
    rank_dir = run.rank_logs(JOB, "node1") / "launch0" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_text(f"{stamp} trainer[0] step 5 loss 2.5\n")
    run.rank_map(JOB, 0).write_text(json.dumps({"0": {"node": "node1", "local_rank": 0}}))


def _server_records(run: RunDir) -> None:
    """What ``jobgen serve`` and its job leave: the job it started, and the server's address."""
    job = {"job_id": "31", "model": "solo", "model_dir": str(run.served / "step-00000020"),
           "checkpoint": "step-00000020", "engine": "transformers", "time_limit_seconds": 3600,
           "submitted_at": "2026-11-27T10:00:00+00:00"}  # fmt: skip
    run.serve_job.write_text(json.dumps(job))
    address = {"job_id": "31", "host": "node1", "port": 8000, "url": "http://node1:8000/v1", "model": "solo",
               "engine": "transformers"}  # fmt: skip
    run.serve_address.write_text(json.dumps(address))


def _own_program_records(run: RunDir) -> None:
    """A Hugging Face Trainer's checkpoint and the task's command plan."""
    from jobgen.launch.command_plan import build_plan, write_plan

    saved = run.checkpoints / "checkpoint-10"
    saved.mkdir(parents=True)
    history = [{"step": s, "loss": 2.0 - s / 20, "learning_rate": 1e-4, "grad_norm": 1.0} for s in (5, 10)]
    history.append({"step": 10, "eval_loss": 1.9})
    (saved / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": history}))
    write_plan(run, build_plan(run.load_spec(), run, str(JOB), 0, "1"))
    # A failure every later task would repeat, as jobgen.runtime.records.record_failure writes it.
    failed = {"exit_code": 3, "reason": "the program could not import its module", "fix": "fix the import",
              "job_id": str(JOB), "restart": 0, "time": NOW - 30}  # fmt: skip
    run.failed_marker.write_text(json.dumps(failed))


def build(root: Path) -> World:
    """The world under ``root`` (Slurm replaced: slurm_answers_nothing)."""
    runs = root / "runs"
    (root / "model").mkdir()
    (root / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    job = {"time": "5m", "exit_grace": "1m", "array": 2, "runs_root": str(runs)}
    solo = _submit(
        run_spec(
            root,
            "solo",
            filename="solo.toml",
            job=job,
            model={"path": "model"},
            data={"path": "data.jsonl"},
            train={"max_steps": 40, "save_every_steps": 10},
            eval={"split": 0.1, "every_steps": 10, "prompts": ["Say hi"]},
        )
    )
    _training_records(solo)
    _server_records(solo)
    script = root / "train.py"
    script.write_text("print('hi')\n")
    own = _submit(
        run_spec(root, "own", filename="own.toml", job={**job, "program": "command"}, command={"script": str(script)})
    )
    _own_program_records(own)
    sweep = _submit_sweep(root, runs)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    world = World(
        root,
        runs,
        solo,
        own,
        sweep,
        RunDir(sorted(p for p in (sweep / POINTS_DIR).iterdir() if (p / "spec.json").is_file())[0]),
        elsewhere,
    )
    world.snapshot()
    return world


def _submit_sweep(root: Path, runs: Path) -> Path:
    """A sweep of two points (jobgen's own submission), and a task's claim of its first point."""
    from jobgen.sweep.claim import main as claim
    from jobgen.sweep.points import load_sweep
    from jobgen.sweep.submit import submit_sweep

    directory = root / "sweep-spec"
    directory.mkdir()
    path = small_sweep(directory)
    path.write_text(path.read_text().replace('runs_root = "runs"', f'runs_root = "{runs}"'))
    submit_sweep(load_sweep(path), source_text=path.read_text(), skip_preflight=True)
    sweep = runs / "lrs"
    with contextlib.redirect_stdout(io.StringIO()):  # what the batch script reads: not the test's output
        claim(["--sweep", str(sweep), "--job", "20", "--array-job", "19", "--task", "1", "--live-unknown"])
    return sweep
