"""What one job of a run records about its training: the lines status, goodput, plot and
``jobgen plan`` read.

- ``metrics.jsonl``: a line per logged step (loss, learning rate, tokens/s since the previous
  line, memory), also sent to ``train.report_to``'s trackers;
- ``tasks.jsonl``: the ``first_step`` line (when this job's first step ended, where its start-up
  went, the step it resumed at) and the ``exit`` line;
- ``metrics.json``: the exit summary (steps and their seconds, saves, evaluations, every rank's
  tokens/s and memory peaks, what was trained on what).

The Trainer (trainer/loop.py) owns the training state and calls this at its step boundaries;
the figures kept here (each step's seconds, this rank's tokens) are of this job only and never
saved in a checkpoint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from jobgen.runtime.records import MetricsWriter
from jobgen.spec.global_batch import BatchShape
from trainer.distributed import DistEnv
from trainer.memory.peaks import MemoryPeaks, combine_ranks
from trainer.metrics import StartupClock, ThroughputWindow, memory_snapshot
from trainer.tracking import Trackers

log = logging.getLogger("trainer")


class JobRecord:
    """This job's records and the figures behind them, on every rank (rank 0 writes)."""

    def __init__(self, run_dir: Path, env: DistEnv, batch: BatchShape, startup: StartupClock):
        self.env = env
        self.batch = batch
        self.startup = startup
        # When the allocation began (the batch script exports it); falls back to this process's start.
        self.job_start = startup.job_start
        self.memory_peaks = MemoryPeaks(env.device)  # per phase: load, first step, steady
        self.metrics = MetricsWriter(run_dir, enabled=env.is_main)
        self.trackers = Trackers([])  # train.report_to, opened when training begins
        self.step_seconds: list[float] = []  # wall time of each optimizer step of this job
        self.local_tokens = 0  # this rank's own share of the tokens trained on by this job
        self.start_step = 0  # the step this job resumed at
        self.resumed_from: str | None = None  # the checkpoint's name, when this job resumed from one
        self.seconds_to_first_step: float | None = None  # job start to the end of this job's first step
        self.summary: dict[str, Any] = {}  # filled when training ends, however it ends

    @property
    def steps(self) -> int:
        """Optimizer steps this job has taken."""
        return len(self.step_seconds)

    def began(self, step: int, resumed_from: str | None, trackers: Trackers) -> None:
        """Training begins at ``step`` (resumed from that checkpoint, or fresh): the load phase
        of the memory peaks ends here, with the model, optimizer and checkpoint in place."""
        self.startup.mark("resume")
        self.start_step, self.resumed_from = step, resumed_from
        self.memory_peaks.end_phase("load")
        self.trackers = trackers

    def step_taken(self, seconds: float, step: int) -> None:
        """An optimizer step ended after ``seconds``; the first of this job writes ``first_step``."""
        self.step_seconds.append(seconds)
        if self.seconds_to_first_step is None:
            self._first_step(step)

    def _first_step(self, step: int) -> None:
        """The ``first_step`` line of ``tasks.jsonl``: when this job's first step ended and where it
        began (goodput and lead time are computed from it)."""
        self.memory_peaks.end_phase("first_step")  # optimizer state is allocated by now
        self.seconds_to_first_step = time.time() - self.job_start
        self.startup.mark("first_step")
        if self.env.is_main:
            log.info("first step %.1f s after the job started: %s", self.seconds_to_first_step, self.startup.summary())
        self.metrics.log_task(
            {
                "event": "first_step",
                "step": step,
                "start_step": self.start_step,
                "job_start": self.job_start,
                "seconds_to_first_step": round(self.seconds_to_first_step, 3),
                "startup_seconds": self.startup.seconds,
                "resumed_from": self.resumed_from,
                **self.batch.to_json(),  # world size and global batch: they may change between tasks
            }
        )

    def log_step(self, step: int, step_metrics: dict[str, float], window: ThroughputWindow, totals: dict) -> None:
        """A ``metrics.jsonl`` line for this step (and a log line on rank 0); tokens/s are over
        the steps since the previous line. ``totals``: the run's token counts so far."""
        record = {
            "step": step,
            **step_metrics,
            "step_seconds": round(self.step_seconds[-1], 4),
            **totals,
            "tokens_per_s": window.tokens_per_s(),
            **memory_snapshot(),
        }
        self.metrics.log_step(record)
        self.trackers.log(step, {k: v for k, v in record.items() if k != "step"})
        if self.env.is_main:
            log.info(
                "step %d loss %.4f lr %.3g grad_norm %.3f",
                step,
                step_metrics["loss"],
                step_metrics["lr"],
                step_metrics["grad_norm"],
            )
        window.reset()

    def ended(self, end_step: int, saves: dict[str, list[float]], evaluations: dict[str, Any]) -> None:
        """Training ended at ``end_step``, however it ended: the steady phase closes and the exit
        summary is kept for :meth:`write_summary`. ``saves``: the checkpointer's save times."""
        self.trackers.close()
        self.memory_peaks.end_phase("steady")
        self.summary = {
            "start_step": self.start_step,
            "end_step": end_step,
            "steps_this_job": self.steps,
            "seconds_to_first_step": self.seconds_to_first_step,
            "job_start": self.job_start,
            "step_seconds_total": round(sum(self.step_seconds), 3),
            "step_seconds_max": round(max(self.step_seconds, default=0.0), 3),
            **{name: [round(s, 3) for s in seconds] for name, seconds in saves.items()},
            **evaluations,
        }

    def write_summary(self, exit_code: int, reason: str, run_facts: dict[str, Any]) -> None:
        """``metrics.json`` and the ``exit`` line of ``tasks.jsonl``: the exit summary with the exit
        code, wall time, every rank's tokens/s and memory peaks, and ``run_facts`` (what was
        trained on what). Collective: every rank calls it."""
        wall = time.time() - self.startup.process_started
        per_rank: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(per_rank, round(self.local_tokens / max(wall, 1e-9), 2))
        peaks: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(peaks, self.memory_peaks.as_dict())
        summary = {
            **self.summary,
            "exit_code": exit_code,
            "exit_reason": reason,
            "wall_seconds": round(wall, 3),
            "tokens_per_s_per_rank": per_rank,
            **self.batch.to_json(),
            **run_facts,
            "memory_peaks": combine_ranks(peaks),
        }
        self.metrics.write_summary(summary)
        self.metrics.log_task({"event": "exit", **summary, "data_stats": None})
