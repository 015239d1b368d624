"""What the trainer measures about itself: memory, and where a job's start-up went.

The records these end up in (``metrics.jsonl``, ``tasks.jsonl``, ``metrics.json``) are
written by :class:`jobgen.runtime.records.MetricsWriter`, which a user's own program
writes through as well.
"""

from __future__ import annotations

import os
import time

import psutil
import torch


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
    exports as JOBGEN_JOB_START (a relaunch's, JOBGEN_LAUNCH_START), else this process's.
    Wall-clock seconds (``time.time``), as the job's start was taken by another process."""

    def __init__(self, process_started: float | None = None):
        process_started = process_started or time.time()
        self.process_started = process_started
        # A relaunch inside the task (job.in_job_restarts) starts its clock when the batch
        # script relaunched it: its time to the first step is what the relaunch cost.
        started = os.environ.get("JOBGEN_LAUNCH_START") or os.environ.get("JOBGEN_JOB_START")
        self.job_start = float(started or process_started)
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


class ThroughputWindow:
    """Tokens and wall time since the last logged step: the tokens/s of a metrics line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.started, self.tokens = time.time(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def tokens_per_s(self) -> float:
        return round(self.tokens / max(time.time() - self.started, 1e-9), 2)
