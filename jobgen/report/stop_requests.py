"""Stop requests that outlived their attempt.

The batch shell's signal trap leaves ``switches/stop.<job>.<restart>`` for the program of
that attempt (``RunDir.stop_request``). A program that polls it removes it once acted on; a
program that never polls it (one jobgen did not write, run unchanged) or an attempt killed
first leaves it behind, and only a requeue of the same job id clears it (the preamble's
``rm -f``). Each array task has its own job id, so without this every ended task's request
stayed in switches/ and ``jobgen status`` listed it as a switch forever.

A request is stale once its attempt has ended, by any record that says so: the program's
exit record (``tasks.jsonl``), the batch script's end record (``logs/task.<job>.<restart>.json``
with an exit code), or an end state Slurm gave the attempt (TIMEOUT, CANCELLED, ...). A task
known only to have started ("ENDED": Slurm forgot it or was not asked) proves nothing and
keeps its request. ``jobgen status`` and ``jobgen stop`` remove stale requests: switches/ is
the team's sticky directory, so a request someone else's job left may not be ours to remove;
that is no error, it is only no longer shown.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jobgen.report.task_table import TaskStatus, read_task_records
from jobgen.runs.goodput import TaskReport, last_launches, run_reports
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm

Attempt = tuple[str, int]  # (job id, restart)


def ended_attempts(
    task_records: dict[tuple[int, int], dict[str, Any]],
    reports: Iterable[TaskReport],
    tasks: Iterable[TaskStatus] = (),
) -> tuple[set[Attempt], set[str]]:
    """(the attempts some record shows ended, the job ids with an attempt Slurm still holds)."""
    ended = {(str(job), restart) for (job, restart), r in task_records.items() if r.get("exit_code") is not None}
    ended |= {attempt for attempt, r in last_launches(reports).items() if r.exit_code is not None}
    active = set()
    for task in tasks:
        if task.state in slurm.JOB_ACTIVE:
            active.add(str(task.job_id))
        elif task.state != "ENDED":  # an end state of Slurm's or of a record: over
            ended.add((str(task.job_id), task.restart))
    return ended, active


def stale_requests(
    requests: list[tuple[Path, str, int | None]], ended: set[Attempt], active_jobs: set[str]
) -> list[Path]:
    """The stop requests (``RunDir.stop_requests``) whose attempt has ended. The bare ``stop.<job>`` (written
    before restart counts were part of the name) is stale once the job has ended and nothing of
    it is queued or running."""
    jobs_ended = {job for job, _ in ended}

    def over(job: str, restart: int | None) -> bool:
        return (job, restart) in ended if restart is not None else job in jobs_ended and job not in active_jobs

    return [path for path, job, restart in requests if over(job, restart)]


def remove(paths: Iterable[Path]) -> list[Path]:
    """Remove what may be removed; a request another user left in the sticky switches/ (or one
    already gone) is left, not an error: it is no longer shown either way."""
    removed = []
    for path in paths:
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def clear_stale(run: RunDir) -> list[Path]:
    """``jobgen stop``: remove the stale requests the run directory's records show, without
    asking Slurm (a stop must work while Slurm does not answer) and without spec.json (a stop
    needs only the directory: a damaged spec must not make a stop that worked look failed).
    Which attempts ended is the exit records' word alone: no time limit is needed for it."""
    if not run.switches.is_dir():
        return []
    ended, active = ended_attempts(read_task_records(run), run_reports(run.path))
    return remove(stale_requests(run.stop_requests(), ended, active))
