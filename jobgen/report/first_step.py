"""``jobgen submit --wait``: after submitting, wait until the job's first optimizer step,
saying where it stands on the way: pending and why (with Slurm's expected start when it
has one), then starting on its nodes, with the time earlier tasks of the run took from
their start to their first step as the estimate.

It reads what ``jobgen status`` reads (one squeue call per poll, the run directory) and
decides nothing about the run: Ctrl-C stops the waiting, not the job.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from jobgen.base.progress import Progress, human_seconds
from jobgen.report.status import queue_for, run_status
from jobgen.report.task_table import TaskStatus
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm


@dataclass(frozen=True)
class Outcome:
    trained: bool  # a task of the submission took its first step
    finished: bool  # the run is finished (a task found nothing to do)
    message: str


def _mine(tasks: list[TaskStatus], job_id: int) -> list[TaskStatus]:
    return [t for t in tasks if job_id in (t.array_job_id, t.job_id)]


def _startup_estimate(tasks: list[TaskStatus], job_id: int) -> float | None:
    """The median start-to-first-step time of the run's earlier tasks."""
    earlier = [t.seconds_to_first_step for t in tasks if t.seconds_to_first_step and t.array_job_id != job_id]
    return statistics.median(earlier) if earlier else None


def where_it_stands(tasks: list[TaskStatus], queue: list[slurm.QueueEntry], job_id: int, now: float) -> str:
    """One line: the submission's state, why, and when to expect the next change."""
    active = [t for t in _mine(tasks, job_id) if t.state in slurm.JOB_ACTIVE]
    running = [t for t in active if t.state not in slurm.JOB_PENDING]
    if running:
        task = running[0]
        since = now - task.start_time if task.start_time else None
        text = f"{task.slurm_id} {task.state.lower()} on {task.nodes or '?'}"
        if since is not None:
            text += f" for {human_seconds(since)}"
        estimate = _startup_estimate(tasks, job_id)
        if estimate is not None and since is not None:
            text += f"; earlier tasks took {human_seconds(estimate)} to their first step"
            text += f" (ETA {human_seconds(estimate - since)})" if estimate > since else ""
        return text
    if active:
        task = active[0]
        text = f"{task.slurm_id} pending ({task.reason or 'no reason yet'})"
        expected = [e.expected_start for e in queue if e.job_id == task.job_id and e.expected_start]
        if expected and expected[0] > now:
            text += f"; Slurm expects it to start in {human_seconds(expected[0] - now)}"
        return text
    return "submitted; not in the queue yet"


def wait_for_first_step(
    run: RunDir,
    job_id: int,
    *,
    poll: float = 2.0,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.time,
) -> Outcome:
    """Poll until a task of submission ``job_id`` has taken its first step, or every task of
    it has ended without one."""
    progress = progress or Progress("waiting for the first step")
    seen_in_slurm = False
    try:
        while True:
            queue = queue_for([run])
            status = run_status(run, queue=queue, details=False)
            mine = _mine(status.tasks, job_id)
            trained = [t for t in mine if t.start_step is not None and t.seconds_to_first_step is not None]
            if trained:
                task = trained[0]
                return Outcome(
                    True,
                    False,
                    f"{task.slurm_id}: first step {task.seconds_to_first_step:.0f} s after it started "
                    f"on {task.nodes or '?'} (from step {task.start_step})",
                )
            active = any(t.state in slurm.JOB_ACTIVE for t in mine)
            seen_in_slurm = seen_in_slurm or active
            # Ended: Slurm held it and holds it no more, or a task recorded its end (one that
            # started and ended between two polls is never seen in the queue).
            ended = seen_in_slurm or any(t.jobgen_exit is not None for t in mine)
            if mine and not active and ended:
                last = mine[-1]
                why = last.exit_reason or last.reason or last.state
                return Outcome(False, status.state == "finished", f"{last.slurm_id} ended before a first step: {why}")
            progress.update(status=where_it_stands(status.tasks, queue, job_id, clock()))
            time.sleep(poll)
    finally:
        progress.close()
