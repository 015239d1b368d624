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


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self.job_id = os.environ.get("SLURM_JOB_ID")
        # A requeued job keeps its id; the restart count tells its runs apart.
        self.restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)

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
            "tasks.jsonl", {"time": round(time.time(), 3), "job_id": self.job_id, "restart": self.restart, **record}
        )

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            write_json_atomic(
                self.run_dir / "metrics.json", {"job_id": self.job_id, "restart": self.restart, **summary}
            )
