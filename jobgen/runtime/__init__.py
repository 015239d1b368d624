"""jobgen's lifecycle for your own program (``[job] program = "command"``): importable
without torch, in the process torchrun started on every node.

    from jobgen import runtime

    job = runtime.current()          # None when not launched by jobgen
    job.run_dir, job.checkpoint_dir  # the run directory and where to keep checkpoints
    job.resuming                     # an earlier task left a checkpoint behind
    job.deadline                     # the job's end minus job.exit_grace (epoch seconds), or None
    job.stop_requested()             # kill switch, Slurm's lead-time signal, SIGTERM, the deadline,
    job.save_requested()             #   the memory guard; the save switch; the abort switch:
    job.abort_requested()            #   the bundled trainer's rules (jobgen.runtime.stopping)

A hand-written loop lets :func:`lifecycle` keep the records and take the decisions that
every rank must agree on (one small all-reduce per call when torch.distributed is up)::

    with runtime.lifecycle() as life:
        for step in range(life.start_step, total):
            train_step()
            action = life.step_done(step + 1, loss=loss)
            if action.saves:
                save(life.checkpoint_dir)
                life.saved()
            if action.exits:
                break

On leaving the block the exit code and reason go where the batch script, ``jobgen
status`` and goodput read them: a stop as planned (time limit, preemption, kill switch)
ends COMPLETED and the next array task resumes; leaving the block without a stop means
the run is finished (later tasks exit at once); an exception ends FAILED. A Hugging Face
``Trainer`` gets all of this from :class:`jobgen.runtime.hf.JobgenCallback`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jobgen.base.exit_codes import ExitCode
from jobgen.runs.quarantine import record_rank_failure
from jobgen.runs.rundir import RunDir
from jobgen.runtime.records import MetricsWriter, crash_reason, reserve_exit_code, user_metrics, write_exit_code
from jobgen.runtime.stopping import Action, StopMonitor, StopSettings, first_signal_caught, job_end_time

__all__ = ["Action", "Job", "Life", "NotUnderJobgen", "current", "lifecycle"]


class NotUnderJobgen(RuntimeError):
    """The process was not started by a jobgen batch script (no ``JOBGEN_RUN_DIR``)."""


class Job:
    """This process's view of its jobgen job: the run directory, the attempt (a requeued
    job keeps its id; the restart count tells attempts apart), this rank, and the stop
    rules. Rank 0 alone reads the switch files (thousands of ranks stat-ing a shared file
    system every step is a metadata storm); :meth:`agreed_action` spreads its answer."""

    def __init__(self, run_dir: Path, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.run = RunDir(Path(run_dir))
        self.spec = self.run.load_spec()
        self.job_id = env.get("SLURM_JOB_ID") or None
        self.restart = int(env.get("SLURM_RESTART_COUNT") or 0)
        self.rank = int(env.get("RANK") or 0)
        self.world_size = int(env.get("WORLD_SIZE") or 1)
        self.job_start = float(env.get("JOBGEN_JOB_START") or time.time())
        job = self.spec.run.job
        graceful = job.graceful_stop
        # Rank 0 asks Slurm (squeue) when the job ends, unless Slurm put it in the environment;
        # agreed_action spreads what rank 0 sees, so thousands of ranks never ask at once.
        asks_slurm = self.is_main or any(
            env.get(v, "").isdigit() for v in ("JOBGEN_JOB_END_TIME", "SLURM_JOB_END_TIME")
        )
        end = job_end_time(self.job_id, env) if graceful and asks_slurm else None
        self.deadline: float | None = end - job.exit_grace if end else None
        stop_request = self.run.stop_request(self.job_id, self.restart) if self.job_id and graceful else None
        self.monitor = StopMonitor(
            StopSettings(
                self.run.switches,
                stop_request,
                self.deadline,
                self.spec.run.train.max_host_memory_percent,
                0,  # the GPU guard needs torch: the bundled trainer's alone
                check_files=self.is_main,
                lead_signal=self.spec.site.slurm.signal,
                exit_grace=job.exit_grace,
            )
        )
        self._handlers_installed = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def run_dir(self) -> Path:
        return self.run.path

    @property
    def checkpoint_dir(self) -> Path:
        """Where the program keeps its checkpoints (``RUN/checkpoints``): every array task
        of the run sees the same directory."""
        return self.run.checkpoints

    @property
    def resuming(self) -> bool:
        """An earlier task of the run left something in the checkpoint directory."""
        return self.checkpoint_dir.is_dir() and any(self.checkpoint_dir.iterdir())

    def install_signal_handlers(self) -> None:
        """SIGUSR1/SIGUSR2/SIGTERM only set a flag that the next check reads (never with
        job.graceful_stop = false: Slurm then ends the job at its limit)."""
        if self.spec.run.job.graceful_stop and not self._handlers_installed:
            self.monitor.install_signal_handlers()
            self._handlers_installed = True

    def action(self) -> Action:
        """What this rank sees now (the switches only on rank 0)."""
        return self.monitor.local_action()

    def agreed_action(self) -> Action:
        """The action every rank takes: the largest any rank sees (collective when
        torch.distributed is initialised; every rank must call it at the same point)."""
        action = self.action()
        dist = sys.modules.get("torch.distributed")
        if dist is None or self.world_size == 1 or not dist.is_available() or not dist.is_initialized():
            return action
        import torch

        device = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
        value = torch.tensor([int(action)], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return Action(int(value.item()))

    def stop_requested(self) -> bool:
        """Save and exit: kill switch, the lead-time signal or SIGTERM, the deadline, memory."""
        action = self.action()
        return action.exits and action.saves

    def save_requested(self) -> bool:
        """The save switch: save and go on (:meth:`consume_save_request` once saved)."""
        return self.action() is Action.SAVE

    def abort_requested(self) -> bool:
        """The abort switch: exit at once without saving."""
        return self.action() is Action.ABORT

    def consume_save_request(self) -> None:
        if self.is_main:
            self.monitor.consume_save_switch()

    def describe(self, action: Action) -> str:
        return self.monitor.describe(action)


def current() -> Job | None:
    """The jobgen job of this process, or None when jobgen did not launch it."""
    run_dir = os.environ.get("JOBGEN_RUN_DIR")
    return Job(Path(run_dir)) if run_dir else None


class Life:
    """The records and decisions of one task of a user's program (see the module docstring)."""

    def __init__(self, job: Job, start_step: int = 0):
        self.job = job
        self.start_step = start_step
        self.step: int | None = None
        self.stopped_by: Action | None = None
        self.finished = False
        self._metrics = MetricsWriter(job.run_dir, enabled=job.is_main)
        self._last = time.time()
        self._step_seconds: list[float] = []
        self._saves: list[float] = []
        self._save_started: float | None = None
        self._first_step_recorded = False

    @property
    def checkpoint_dir(self) -> Path:
        return self.job.checkpoint_dir

    def begin(self, start_step: int) -> None:
        """The step this task resumed at (0 for a fresh run)."""
        self.start_step = start_step
        self._last = time.time()

    def step_done(self, step: int, **metrics: float) -> Action:
        """Step ``step`` is done: record it (progress for status, goodput and the hang
        watchdog) and return what every rank does now. Collective: all ranks call it."""
        now = time.time()
        seconds, self._last = now - self._last, now
        self._step_seconds.append(seconds)
        self.step = step
        if not self._first_step_recorded:
            self._first_step_recorded = True
            self._metrics.log_task(
                {
                    "event": "first_step",
                    "step": step,
                    "start_step": self.start_step,
                    "job_start": self.job.job_start,
                    "seconds_to_first_step": round(now - self.job.job_start, 3),
                }
            )
        # The user's metrics first: a colliding name is renamed, and step/step_seconds are ours.
        self._metrics.log_step({**user_metrics(metrics), "step": step, "step_seconds": round(seconds, 4)})
        action = self.job.agreed_action()
        if action.saves:
            self._save_started = time.time()
        if action.exits:
            self.stopped_by = action
        return action

    def saved(self) -> None:
        """The checkpoint asked for by the last :meth:`step_done` is written."""
        if self._save_started is not None:
            self._saves.append(time.time() - self._save_started)
            self._save_started = None
        self._last = time.time()  # the save is no step time
        if self.stopped_by is None:
            self.job.consume_save_request()
        elif self.job.is_main:
            self.job.monitor.consume_stop_request()  # acted on: the stop request is spent

    def should_stop(self, step: int, **metrics: float) -> bool:
        """:meth:`step_done`, answered as "leave the loop now" (save first when
        :attr:`wants_save`)."""
        return self.step_done(step, **metrics).exits

    @property
    def wants_save(self) -> bool:
        return self._save_started is not None

    def finish(self, code: ExitCode, reason: str) -> None:
        """Rank 0: the exit code for the batch script, the ``exit`` record, and the done
        marker when the run is finished."""
        if not self.job.is_main:
            return
        if code is ExitCode.OK and self.finished:
            self.job.run.done_marker.write_text(f"finished at step {self.step}\n")
        summary = {
            "start_step": self.start_step,
            "end_step": self.step if self.step is not None else self.start_step,
            "job_start": self.job.job_start,
            "step_seconds_total": round(sum(self._step_seconds), 3),
            "step_seconds_max": round(max(self._step_seconds, default=0.0), 3),
            "save_seconds": [round(s, 3) for s in self._saves],
            "exit_code": int(code),
            "exit_reason": reason,
        }
        self._metrics.log_task({"event": "exit", **summary})
        self._metrics.write_summary(summary)
        if self.job.job_id:
            write_exit_code(self.job.run, self.job.job_id, self.job.restart, code, reason)

    def rank_failed(self, exc: BaseException) -> None:
        """Every rank an error reaches says so, with how long it had gone without a step:
        the batch script blames the node of a rank that went silent while others waited out
        a collective timeout (jobgen.runs.quarantine; train.collective_timeout is the timeout it
        compares with: set it to your program's)."""
        if self.job.job_id:
            waited = time.time() - self._last
            record_rank_failure(
                self.job.run, self.job.job_id, self.job.restart, self.job.rank, waited, exc, first_signal_caught()
            )

    def outcome(self) -> tuple[ExitCode, str]:
        """The exit code and reason of a task that left its loop without an exception."""
        if self.stopped_by is not None:
            return self.stopped_by.exit_code, self.job.describe(self.stopped_by)
        self.finished = True
        return ExitCode.OK, f"finished at step {self.step}" if self.step is not None else "finished"


@contextmanager
def lifecycle(start_step: int = 0, job: Job | None = None) -> Iterator[Life]:
    """A task of a hand-written training loop under jobgen (see the module docstring).
    Raises :class:`NotUnderJobgen` when jobgen did not start this process."""
    job = job or current()
    if job is None:
        raise NotUnderJobgen("jobgen.runtime.lifecycle() needs the JOBGEN_RUN_DIR a jobgen batch script sets")
    job.install_signal_handlers()
    if job.is_main and job.job_id:
        reserve_exit_code(job.run, job.job_id, job.restart)  # the reason gets out of a full disk
    life = Life(job, start_step)
    try:
        yield life
    except BaseException as exc:
        life.rank_failed(exc)
        life.finish(ExitCode.CRASHED, crash_reason(exc, job.run_dir))
        raise
    life.finish(*life.outcome())
