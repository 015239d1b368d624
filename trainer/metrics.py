"""Metrics: one JSON line per logging step in ``metrics.jsonl``, a summary in ``metrics.json``.

Only rank 0 writes. ``metrics.jsonl`` is append-only (a reader tolerates a cut last
line); ``metrics.json`` is replaced atomically at exit. Per array task, a line in
``tasks.jsonl`` records where it started and ended, so lost work and goodput can
be computed after the fact.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from jobgen.atomic import write_json_atomic


def memory_snapshot() -> dict[str, float]:
    snap = {
        "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
        "host_used_percent": psutil.virtual_memory().percent,
    }
    if torch.cuda.is_available():
        snap["gpu_max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        free, _total = torch.cuda.mem_get_info()
        snap["gpu_free_mib"] = round(free / 2**20, 1)
    return snap


class StartupClock:
    """Where a job's start went, phase by phase, up to the end of its first step.

    Each ``mark(phase)`` ends ``phase`` at the current time (a phase marked twice adds up);
    the first phase began at ``job_start``: the allocation's start, which the batch script
    exports as JOBGEN_JOB_START, else this process's. Wall-clock seconds (``time.time``), as
    the job's start was taken by another process."""

    def __init__(self, process_started: float | None = None):
        process_started = process_started or time.time()
        self.process_started = process_started
        self.job_start = float(os.environ.get("JOBGEN_JOB_START") or process_started)
        self._last = self.job_start
        self.seconds: dict[str, float] = {}
        # Scheduler, srun, torchrun and the interpreter, up to this process's main().
        self.mark("launch", at=process_started)

    def mark(self, phase: str, at: float | None = None) -> None:
        now = time.time() if at is None else at
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + max(now - self._last, 0.0), 3)
        self._last = now

    def summary(self) -> str:
        return ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in self.seconds.items())


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self.job_id = os.environ.get("SLURM_JOB_ID")
        # A requeued job keeps its id; the restart count tells its runs apart.
        self.restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        # Slurm's name of the task (ARRAY_TASK), for status after Slurm forgot the job.
        self.array = {
            "array_job_id": os.environ.get("SLURM_ARRAY_JOB_ID"),
            "array_task": os.environ.get("SLURM_ARRAY_TASK_ID"),
        }

    def _append(self, name: str, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with (self.run_dir / name).open("a") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def log_step(self, record: dict[str, Any]) -> None:
        self._append(
            "metrics.jsonl", {"time": round(time.time(), 3), "job_id": self.job_id, "restart": self.restart, **record}
        )

    def log_task(self, record: dict[str, Any]) -> None:
        self._append(
            "tasks.jsonl",
            {"time": round(time.time(), 3), "job_id": self.job_id, "restart": self.restart, **self.array, **record},
        )

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            write_json_atomic(
                self.run_dir / "metrics.json", {"job_id": self.job_id, "restart": self.restart, **summary}
            )
