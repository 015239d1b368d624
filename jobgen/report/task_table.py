"""A run's array tasks as ``jobgen status`` shows them: Slurm's view merged with what the
run directory recorded, so that every task keeps its steps, times and reason after Slurm
has forgotten it (MinJobAge, a restarted controller, no accounting).

Sources, each read once:

- ``jobs.json``: every submission (the array's id, its size);
- Slurm's queue (one ``squeue`` for every run the caller looks at): tasks pending or running;
- the batch script's record of each attempt's end (``RunDir.task_record``): ids, nodes,
  start, end, jobgen's exit code, what Slurm was told, the reason in words;
- the trainer's reports (:mod:`jobgen.runs.goodput`): steps, recomputed steps, first step;
- what Slurm remembers of ended jobs (``slurm.ended_jobs``), asked only for submissions
  the records above leave unexplained (a task cancelled while pending, one killed outright
  at its limit or with its node).

A task is one attempt of one job: a requeued job runs again under the same id, and the
restart count tells the attempts apart. Inside one attempt the program may have been launched
again after a failure (job.in_job_restarts): the task's row holds each relaunch, with the
batch script's reason and the trainer's time to its first step (what the relaunch cost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jobgen.base.durations import parse_slurm_limit
from jobgen.base.exit_codes import ExitCode
from jobgen.base.safe_read import DamagedFile, as_int, is_int, is_time, read_json
from jobgen.base.visible import visible
from jobgen.runs.goodput import TaskReport, last_launches
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm

# A task the time limit killed before its program recorded a stop of its own (a program that
# ignores the lead-time signal, or a save too slow for exit_grace): Slurm's TIMEOUT.
TIME_LIMIT_KILLED = "time limit: killed by Slurm (no stop recorded by the program)"
# Slurm kills at the limit or up to a minute later, but the batch script's clock (job_start)
# starts a moment after Slurm's: its elapsed time may fall short of the limit by that moment.
TIME_LIMIT_SLACK_SECONDS = 15

# What Slurm's own end states mean, for a task that left no words of its own.
_SLURM_ENDS = {
    "TIMEOUT": TIME_LIMIT_KILLED,
    "CANCELLED": "cancelled",
    "NODE_FAIL": "a node failed",
    "OUT_OF_MEMORY": "out of memory (killed by Slurm)",
    "BOOT_FAIL": "its nodes failed to boot",
    "PREEMPTED": "preempted",
    "DEADLINE": "past its --deadline",
}


@dataclass
class Relaunch:
    """One relaunch of the program inside a task (job.in_job_restarts)."""

    launch: int  # 1 for the first relaunch
    time: float | None = None  # when the batch script started it (epoch seconds)
    after_exit: int | None = None  # how the launch before it ended (jobgen's code, or the launcher's status)
    reason: str | None = None  # the batch script's words for that
    start_step: int | None = None  # the step it resumed at
    seconds_to_first_step: float | None = None  # from the relaunch to its first step: what it cost
    recomputed_steps: int | None = None  # steps the launch before it had done beyond start_step
    nodes: str | None = None  # the nodes it trained on, where the task holds spares (job.spare_nodes)


@dataclass
class TaskStatus:
    job_id: int
    array_job_id: int
    array_task: str  # task index, or "N/A" outside an array
    state: str  # Slurm's state; for tasks Slurm forgot, COMPLETED or FAILED as the script told it
    exit_code: str | None = None  # Slurm's "N:S", when Slurm still says
    reason: str | None = None  # Slurm's reason (why pending, why it ended)
    nodes: str | None = None
    # From the trainer's own records (jobgen.runs.goodput); None for tasks that did not train.
    start_step: int | None = None
    end_step: int | None = None
    recomputed_steps: int | None = None
    seconds_to_first_step: float | None = None
    exit_reason: str | None = None  # why it ended, in words
    restart: int = 0
    start_time: float | None = None  # epoch seconds
    elapsed_seconds: float | None = None
    time_limit_seconds: int | None = None
    jobgen_exit: int | None = None  # jobgen's exit code (jobgen.base.exit_codes), before planned stops became 0
    comment: str | None = None  # Slurm's comment, which the batch script sets as it exits
    world_size: int | None = None  # ranks the trainer ran on (may differ between tasks)
    global_batch: int | None = None  # sequences per optimizer step over all ranks
    relaunches: list[Relaunch] = field(default_factory=list)  # the program's, inside this task

    @property
    def slurm_id(self) -> str:
        """Slurm's name for it: ``ARRAYID_TASK`` (``2_1``), or the job id outside an array."""
        return f"{self.array_job_id}_{self.array_task}" if as_int(self.array_task) is not None else str(self.job_id)


# What each field of a batch script's end record must be when present (None allowed).
_RECORD_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "array_job_id": (lambda v: v == "" or as_int(v) is not None, "a job id"),
    "array_task": (lambda v: v == "" or as_int(v) is not None, "an array task"),
    "nodes": (lambda v: isinstance(v, str), "a node list"),
    "job_start": (is_time, "a time"),
    "end": (is_time, "a time"),
    "exit_code": (is_int, "an exit code"),
    "slurm_exit": (is_int, "an exit code"),
    "reason": (lambda v: isinstance(v, str), "words"),
    "restarts": (lambda v: isinstance(v, list), "a list"),
}


class TaskRecords(dict):
    """The batch script's end records by (job id, restart), with the files skipped as no such
    record and why the first of them was."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[str] = []

    def warning(self) -> str | None:
        if not self.skipped:
            return None
        more = f" (and {len(self.skipped) - 1} more such file(s))" if len(self.skipped) > 1 else ""
        return f"{self.skipped[0]}: skipped as no record of a task's end{more}"


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    if as_int(record.get("job_id")) is None or as_int(record.get("restart") or 0) is None:
        return "no job id and restart count"
    for key, (ok, what) in _RECORD_FIELDS.items():
        if record.get(key) is not None and not ok(record[key]):
            return f"{key!r} is not {what}"
    return None


def read_task_records(run: RunDir) -> TaskRecords:
    """The batch script's end records, by (job id, restart). A node that died mid-write
    leaves only the temporary file, which is not matched; a file that is no such record (cut,
    edited, a link) is skipped and named in ``warning()``."""
    out = TaskRecords()
    for path in run.task_records():
        try:
            record = read_json(path)
        except DamagedFile as exc:
            out.skipped.append(str(exc))
            continue
        except FileNotFoundError:  # replaced by the next attempt's write meanwhile
            continue
        problem = _record_problem(record)
        if problem is not None:
            out.skipped.append(f"{visible(path)}: {problem}")
            continue
        out[(as_int(record["job_id"]), as_int(record.get("restart") or 0))] = record
    return out


def _int(value: Any, default: int) -> int:
    """A job id or an array task from a record or Slurm (jobgen.base.safe_read.as_int), else ``default``."""
    number = as_int(value)
    return default if number is None else number


def unexplained_submissions(
    run: RunDir, queue: list[slurm.QueueEntry], records: dict[tuple[int, int], dict[str, Any]]
) -> list[int]:
    """The submissions whose tasks the queue and the run directory do not all account for:
    the only ones worth asking Slurm about (ended jobs)."""
    seen: dict[int, set[int]] = {}
    for entry in queue:
        if as_int(entry.array_task) is not None:
            seen.setdefault(entry.array_job_id, set()).add(_int(entry.array_task, 0))
        else:
            seen.setdefault(entry.array_job_id, set()).add(0)
    for (job_id, _restart), record in records.items():
        array_job = _int(record.get("array_job_id"), job_id)
        seen.setdefault(array_job, set()).add(_int(record.get("array_task"), 0))
    unexplained = []
    for sub in run.jobs():
        if sub.get("local"):
            continue
        array = sub.get("array")
        wanted = set(range(1, int(array) + 1)) if array else {0}
        if not wanted <= seen.get(int(sub["job_id"]), set()):
            unexplained.append(int(sub["job_id"]))
    return unexplained


def build_tasks(
    run: RunDir,
    name: str,
    queue: list[slurm.QueueEntry],
    ended: list[slurm.JobRecord],
    reports: list[TaskReport],
    records: dict[tuple[int, int], dict[str, Any]],
    time_limit: int | None,
    *,
    slurm_answered: bool = True,
) -> list[TaskStatus]:
    """Every attempt of every task of the run, oldest first. ``queue`` and ``ended`` may
    hold other runs' jobs: only jobs called ``name`` are taken (job ids are unique only for
    one controller's lifetime, so a recycled id cannot pass another job off as the run's)."""
    rows: dict[tuple[int, int], TaskStatus] = {}

    def row(job_id: int, restart: int, array_job_id: int | None = None, array_task: str | None = None) -> TaskStatus:
        task = rows.get((job_id, restart))
        if task is None:
            task = rows[(job_id, restart)] = TaskStatus(job_id, job_id, "N/A", "ENDED", restart=restart)
            task.time_limit_seconds = time_limit
        if array_job_id is not None and array_task and as_int(array_task) is not None:
            task.array_job_id, task.array_task = array_job_id, array_task
        return task

    _apply_records(row, records)
    _apply_reports(row, reports)
    _apply_slurm_memory(rows, row, [r for r in ended if r.name == name])
    ours = [e for e in queue if e.name == name]
    # An array's tasks that never started share the array's id until they start: a row each.
    waiting = [e for e in ours if _never_started(e, rows.values())]
    _apply_queue(rows, row, [e for e in ours if e not in waiting], time_limit)
    _mark_requeued(rows)
    # A run by hand outside Slurm has no job id ("None" in its records): it has no row either.
    program_ended = {
        (_int(r.job_id, -1), r.restart) for r in last_launches(reports).values() if r.exit_code is not None
    }
    _name_time_limit_kills(rows, program_ended)
    tasks = list(rows.values())
    if slurm_answered:
        tasks += _tasks_never_seen(run, tasks, waiting)
    tasks += [_waiting_task(entry, time_limit) for entry in waiting]
    return sorted(tasks, key=lambda t: (t.array_job_id, _int(t.array_task, 0), t.restart, t.job_id))


def _apply_records(row, records: dict[tuple[int, int], dict[str, Any]]) -> None:
    """What the batch script recorded of each attempt: its nodes, start, and how it ended."""
    for (job_id, restart), record in sorted(records.items()):
        array_task = str(record.get("array_task") or "")
        task = row(job_id, restart, _int(record.get("array_job_id"), job_id), array_task)
        task.nodes = record.get("nodes") or None
        task.start_time = record.get("job_start")
        task.relaunches = _recorded_relaunches(record.get("restarts") or [])
        if record.get("exit_code") is None:
            continue  # started, no end recorded: running, or killed before it could say
        task.jobgen_exit = _int(record.get("exit_code"), -1)
        task.state = "COMPLETED" if record.get("slurm_exit") == 0 else "FAILED"
        task.exit_reason = record.get("reason") or None
        if record.get("job_start") and record.get("end"):
            task.elapsed_seconds = float(record["end"]) - float(record["job_start"])


def _recorded_relaunches(entries: list[Any]) -> list[Relaunch]:
    """The batch script's relaunches of a task (its record's ``restarts``); an entry that is no
    such thing (an edited record) is left out."""
    out = []
    for entry in entries:
        if not isinstance(entry, dict) or not is_int(entry.get("launch")) or entry["launch"] < 1:
            continue
        when, code, words, nodes = entry.get("time"), entry.get("after_exit"), entry.get("reason"), entry.get("nodes")
        out.append(
            Relaunch(
                entry["launch"],
                time=when if is_time(when) else None,
                after_exit=code if is_int(code) else None,
                reason=words if isinstance(words, str) else None,
                nodes=nodes if isinstance(nodes, str) else None,
            )
        )
    return out


def _apply_reports(row, reports: list[TaskReport]) -> None:
    """The trainer's reports: steps, and its own words on how the attempt ended. An attempt's
    first launch gives where it began; its newest, where it got and how it ended; each
    relaunch, what it cost."""
    attempts: dict[tuple[int, int], list[TaskReport]] = {}
    for report in reports:
        job_id = as_int(report.job_id)
        if job_id is not None:  # None: a run by hand outside Slurm
            attempts.setdefault((job_id, report.restart), []).append(report)
    for (job_id, restart), launches in attempts.items():
        launches.sort(key=lambda r: r.launch)
        first, last = launches[0], launches[-1]
        task = row(job_id, restart, _int(last.array_job_id, job_id), last.array_task)
        task.start_step, task.end_step = first.start_step, last.end_step
        task.recomputed_steps = sum(r.recomputed_steps for r in launches)
        task.seconds_to_first_step = first.seconds_to_first_step
        task.world_size, task.global_batch = last.world_size, last.global_batch
        _apply_relaunches(task, [r for r in launches if r.launch > 0])
        # The program's own words win, but not goodput's guess for a program that left no
        # exit record ("killed?") over what the batch script recorded (a node failure, ...).
        if last.exit_reason and (last.exit_code is not None or not task.exit_reason):
            task.exit_reason = last.exit_reason
        if last.exit_code is not None and (task.jobgen_exit is None):
            task.jobgen_exit = last.exit_code
            task.state = "COMPLETED" if ExitCode(last.exit_code).planned else "FAILED"


def _apply_relaunches(task: TaskStatus, relaunched: list[TaskReport]) -> None:
    """The trainer's side of each relaunch (where it resumed, what it cost) beside the batch
    script's (when and why); a relaunch the script's record does not hold yet still counts."""
    recorded = {r.launch: r for r in task.relaunches}
    for report in relaunched:
        relaunch = recorded.get(report.launch) or Relaunch(report.launch)
        relaunch.start_step = report.start_step
        relaunch.seconds_to_first_step = report.seconds_to_first_step
        relaunch.recomputed_steps = report.recomputed_steps
        recorded[report.launch] = relaunch
    task.relaunches = [recorded[launch] for launch in sorted(recorded)]


def _name_time_limit_kills(rows: dict[tuple[int, int], TaskStatus], program_ended: set[tuple[int, int]]) -> None:
    """Attempts the time limit killed before their program recorded how it ended are TIMEOUT,
    with words that say so. Slurm says TIMEOUT while it remembers the job; after that (MinJobAge,
    no accounting) the batch script's record is all there is, and it holds the launcher's status
    after the kill, which reads as a crash: an attempt whose recorded run reached its time limit
    was killed by it. The program's own exit record, where there is one, keeps its words."""
    for key, task in rows.items():
        if key in program_ended:
            continue
        if task.state == "FAILED" and _not_jobgens_code(task.jobgen_exit) and _reached_limit(task):
            task.state = "TIMEOUT"
        if task.state == "TIMEOUT":
            task.exit_reason = TIME_LIMIT_KILLED
            # What the batch script recorded is the launcher's status after the kill, not a
            # code the program chose (jobgen.base.exit_codes): shown as "exit 1" it reads as a crash.
            task.jobgen_exit = None


def _not_jobgens_code(code: int | None) -> bool:
    """A status that names no jobgen decision: CRASHED (what torchrun's own status maps to)
    or a number outside jobgen.base.exit_codes (a signal's 128+N)."""
    return code is None or code == ExitCode.CRASHED or code not in {int(c) for c in ExitCode}


def _reached_limit(task: TaskStatus) -> bool:
    if task.elapsed_seconds is None or not task.time_limit_seconds:
        return False
    return task.elapsed_seconds >= task.time_limit_seconds - TIME_LIMIT_SLACK_SECONDS


def _mark_requeued(rows: dict[tuple[int, int], TaskStatus]) -> None:
    """An earlier attempt of a job that ran again was requeued."""
    latest: dict[int, int] = {}
    for job_id, restart in rows:
        latest[job_id] = max(latest.get(job_id, 0), restart)
    for (job_id, restart), task in rows.items():
        if restart < latest[job_id] and task.state == "ENDED":
            task.state = "REQUEUED"


def _waiting_task(entry: slurm.QueueEntry, time_limit: int | None) -> TaskStatus:
    """A row for an array task that never started (it carries the array's id)."""
    task = TaskStatus(entry.job_id, entry.array_job_id, entry.array_task, entry.state, reason=entry.reason or None)
    task.time_limit_seconds = parse_slurm_limit(entry.time_limit) or time_limit
    return task


def _tasks_never_seen(run: RunDir, tasks: list[TaskStatus], waiting: list[slurm.QueueEntry]) -> list[TaskStatus]:
    """A row for each submitted task that nothing knows of: Slurm forgot it and it left no
    record in the run directory (it never ran: cancelled while pending, or the whole
    submission is older than Slurm's memory and never reached the trainer)."""
    seen = {(t.array_job_id, t.array_task) for t in tasks} | {(e.array_job_id, e.array_task) for e in waiting}
    seen |= {(t.job_id, "N/A") for t in tasks}
    out = []
    for sub in run.jobs():
        if sub.get("local"):
            continue
        job_id, size = int(sub["job_id"]), int(sub.get("array") or 0)
        siblings = any(t.array_job_id == job_id for t in tasks)
        for index in [str(i) for i in range(1, size + 1)] if size else ["N/A"]:
            if (job_id, index) not in seen:
                task = TaskStatus(job_id, job_id, index, "ENDED")
                task.exit_reason = (
                    "never ran (cancelled while pending), and Slurm no longer remembers it"
                    if siblings
                    else "no record: Slurm forgot the job and it left none in the run directory"
                )
                out.append(task)
    return out


def _never_started(entry: slurm.QueueEntry, known) -> bool:
    """A pending array task that never ran (it carries the array's id until it starts),
    not a requeued one waiting to run again."""
    if entry.state not in slurm.JOB_PENDING or entry.job_id != entry.array_job_id or as_int(entry.array_task) is None:
        return False
    return not any(t.job_id == entry.job_id and t.array_task == entry.array_task for t in known)


def _apply_slurm_memory(rows, row, ended: list[slurm.JobRecord]) -> None:
    """Slurm's record describes a job's latest attempt: its state wins over the run
    directory's guess (TIMEOUT, CANCELLED and NODE_FAIL leave no record of their own)."""
    for record in ended:
        task = row(record.job_id, record.restarts, record.array_job_id, record.array_task)
        if record.state not in slurm.JOB_ACTIVE:
            task.state = record.state
        task.exit_code = record.exit_code or None
        task.reason = record.reason if record.reason not in ("", "None") else task.reason
        task.nodes = record.nodes if record.nodes not in ("", "(null)") else task.nodes
        task.comment = record.comment or None
        task.start_time = task.start_time or record.start
        if task.elapsed_seconds is None and record.start and record.end:
            task.elapsed_seconds = record.end - record.start
        task.time_limit_seconds = record.time_limit or task.time_limit_seconds
        if not task.exit_reason:
            task.exit_reason = record.comment.removeprefix("jobgen: ") or _SLURM_ENDS.get(record.state)


# Slurm's StartTime and the batch script's first `date` differ by the prolog's seconds; a
# requeued attempt starts minutes later (Slurm holds a requeued job back before it runs again).
SAME_START_SECONDS = 60


def _started_before_its_end(task: TaskStatus, entry: slurm.QueueEntry) -> bool:
    """Squeue's RUNNING entry is the recorded attempt still exiting (its program or batch
    script wrote how it ended, and it is tearing down), not a requeued one: that starts after
    the recorded one ended."""
    if entry.start is None or task.start_time is None:
        return False
    if task.elapsed_seconds is not None and entry.start <= task.start_time + task.elapsed_seconds:
        return True
    return abs(entry.start - task.start_time) < SAME_START_SECONDS


def _apply_queue(rows, row, queue: list[slurm.QueueEntry], time_limit: int | None) -> None:
    """Pending and running tasks. A job id that ended before and is queued again was
    requeued: its new attempt is the one after the last recorded."""
    for entry in queue:
        # The attempt Slurm runs now: the newest one that has not ended by any record (no
        # exit code from the batch script or the trainer), else the one after the newest.
        attempts = sorted(r for (j, r) in rows if j == entry.job_id)
        newest_open = bool(attempts) and rows[(entry.job_id, attempts[-1])].jobgen_exit is None
        ending = entry.state in slurm.JOB_ENDING or entry.state not in slurm.JOB_ACTIVE
        if (
            attempts
            and not newest_open
            and (ending or _started_before_its_end(rows[(entry.job_id, attempts[-1])], entry))
        ):
            # No new attempt: the recorded one being cleaned up (COMPLETING), or squeue --jobs
            # still listing how it ended (MinJobAge). The recorded end is final, Slurm's word
            # on how it ended wins as in _apply_slurm_memory; a row of its own would show the
            # task twice (COMPLETED and COMPLETING) and keep the run "running".
            task = rows[(entry.job_id, attempts[-1])]
            if entry.state not in slurm.JOB_ACTIVE:
                task.state = entry.state
            continue
        restart = (attempts[-1] if newest_open else attempts[-1] + 1) if attempts else 0
        task = row(entry.job_id, restart, entry.array_job_id, entry.array_task)
        task.state = entry.state
        task.reason = entry.reason if entry.reason not in ("", "None") else None
        task.nodes = entry.nodes or None
        task.start_time = entry.start or task.start_time
        task.elapsed_seconds = parse_slurm_limit(entry.elapsed) if entry.elapsed else None
        task.time_limit_seconds = parse_slurm_limit(entry.time_limit) or time_limit
