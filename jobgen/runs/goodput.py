"""Lost work, goodput and lead time, computed after the fact from the run directory.

Owns the per-task reports (:class:`TaskReport`, :func:`task_reports`) and what is
derived from them: goodput, the ``exit_grace`` a run needs, and the warnings when
``exit_grace`` or Slurm's SIGTERM-to-SIGKILL window is too short for a save.

The trainer's rank 0 appends to ``tasks.jsonl`` a ``first_step`` record when a job
(array task) takes its first optimizer step and an ``exit`` record when it leaves;
``metrics.jsonl`` has a line per logging step. A job killed outright (SIGKILL, node
loss) leaves no exit record; its last metrics line stands in. From these:

- recomputed steps of a task: steps an earlier task had already done beyond the
  checkpoint this task resumed from;
- goodput: time spent on steps that were kept, over the time the jobs held their
  allocation (job start to trainer exit);
- the lead time a run needs: ``exit_grace`` must cover the slowest step plus the
  slowest save, with room to spare, or a time limit catches a save half-way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jobgen.runs.jsonl_records import TaskKey, read_tasks, task_key
from jobgen.runs.metrics_summary import MetricsSummary, TaskMetrics, summarize_records

# exit_grace must be at least this many times (slowest step + slowest save) ...
LEAD_FACTOR = 2.0
# ... plus this much for the step boundary check, process teardown and slow filesystems.
LEAD_SLACK_SECONDS = 10.0


@dataclass
class TaskReport:
    job_id: str
    restart: int = 0  # Slurm's restart count: a requeued job runs again under the same id
    launch: int = 0  # the program's relaunch inside the task (job.in_job_restarts): 0 is its first
    start_step: int | None = None
    end_step: int | None = None
    recomputed_steps: int = 0
    seconds_to_first_step: float | None = None
    exit_code: int | None = None
    exit_reason: str | None = None
    step_seconds_total: float | None = None
    step_seconds_max: float | None = None
    save_seconds_max: float | None = None
    # The longest round of an evaluation's micro-batches: a stop during an evaluation waits
    # for the round in flight before it saves.
    eval_round_seconds_max: float | None = None
    allocated_seconds: float | None = None
    useful_seconds: float | None = None
    # Slurm's array id and task index, as the trainer's records name them (None before
    # jobgen recorded them, or outside an array).
    array_job_id: str | None = None
    array_task: str | None = None
    # The task's world and the sequences of one optimizer step: both may change between tasks.
    world_size: int | None = None
    global_batch: int | None = None

    @property
    def key(self) -> TaskKey:
        return self.job_id, self.restart, self.launch

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def last_launches(reports: Iterable[TaskReport]) -> dict[tuple[str, int], TaskReport]:
    """Each attempt's (job id, restart) newest launch: the one that says how the attempt ended
    or is going (an earlier launch's exit is the failure the batch script relaunched after)."""
    last: dict[tuple[str, int], TaskReport] = {}
    for report in reports:
        held = last.get((report.job_id, report.restart))
        if held is None or report.launch >= held.launch:
            last[(report.job_id, report.restart)] = report
    return last


def task_reports(
    tasks: list[dict[str, Any]],
    metrics: MetricsSummary | list[dict[str, Any]],
    *,
    time_limit: float | None = None,
    now: float | None = None,
    saved_step: int | None = None,
) -> list[TaskReport]:
    """One report per run of a job that trained (a requeued job runs again), in order.

    A job killed outright left no exit record; it held its allocation until it was killed,
    which no record says. It is taken to have held it until the job's ``time_limit`` or
    the next job's start, whichever came first (the usual kill is the time limit, which the
    next array task follows within seconds; after a node loss this overstates the
    allocation, never understates it), and not beyond ``now``. Without a time limit, until
    its last metrics line. ``saved_step`` (the newest complete checkpoint) bounds what the
    last job kept when it was killed: its steps after that are lost.
    """
    summary = metrics if isinstance(metrics, MetricsSummary) else summarize_records(metrics)
    reports, job_starts = _reports_from_task_records(tasks)
    _fill_in_killed_jobs(reports, job_starts, summary.tasks)
    ordered = list(reports.values())
    if time_limit is not None:
        _allocation_of_killed_jobs(ordered, job_starts, time_limit, now)
    _count_recomputed_steps(ordered)
    _count_useful_seconds(ordered, saved_step)
    return ordered


def _allocation_of_killed_jobs(
    reports: list[TaskReport], job_starts: dict[TaskKey, float], time_limit: float, now: float | None
) -> None:
    for i, report in enumerate(reports):
        start = job_starts.get(report.key)
        if report.exit_code is not None or start is None or report.allocated_seconds is None:
            continue
        later = [job_starts.get(r.key) for r in reports[i + 1 :]]
        next_start = min((t for t in later if t is not None and t > start), default=None)
        end = min(t for t in (start + time_limit, next_start, now) if t is not None)
        report.allocated_seconds = round(max(report.allocated_seconds, end - start), 3)


def _reports_from_task_records(tasks: list[dict[str, Any]]) -> tuple[dict[TaskKey, TaskReport], dict[TaskKey, float]]:
    """A report per task from its ``first_step`` and ``exit`` records of ``tasks.jsonl``, and
    when each task's job started."""
    reports: dict[TaskKey, TaskReport] = {}
    job_starts: dict[TaskKey, float] = {}
    for record in tasks:
        key = task_key(record)
        report = reports.setdefault(key, TaskReport(job_id=key[0], restart=key[1], launch=key[2]))
        event = record.get("event")
        if record.get("array_task"):
            report.array_job_id, report.array_task = str(record.get("array_job_id")), str(record["array_task"])
        if event == "first_step":
            _apply_first_step(report, record)
        elif event == "exit":
            _apply_exit(report, record)
        if event in ("first_step", "exit") and record.get("job_start") is not None:
            job_starts[key] = float(record["job_start"])
    return reports, job_starts


def _apply_first_step(report: TaskReport, record: dict[str, Any]) -> None:
    report.start_step = record.get("start_step")
    report.seconds_to_first_step = record.get("seconds_to_first_step")
    _apply_batch(report, record)


def _apply_batch(report: TaskReport, record: dict[str, Any]) -> None:
    report.world_size = record.get("world_size", report.world_size)
    report.global_batch = record.get("global_batch", report.global_batch)


def _apply_exit(report: TaskReport, record: dict[str, Any]) -> None:
    report.start_step = record.get("start_step", report.start_step)
    report.end_step = record.get("end_step")
    report.exit_code = record.get("exit_code")
    report.exit_reason = record.get("exit_reason")
    report.step_seconds_total = record.get("step_seconds_total")
    report.step_seconds_max = record.get("step_seconds_max")
    report.save_seconds_max = max(record.get("save_seconds") or [0.0]) or None
    report.eval_round_seconds_max = record.get("eval_round_seconds_max")
    _apply_batch(report, record)
    if record.get("job_start") is not None:
        report.allocated_seconds = round(float(record["time"]) - float(record["job_start"]), 3)


def _fill_in_killed_jobs(
    reports: dict[TaskKey, TaskReport], job_starts: dict[TaskKey, float], by_task: dict[TaskKey, TaskMetrics]
) -> None:
    """Jobs that died without an exit record: their last metrics line is the best we know."""
    for key, report in reports.items():
        lines = by_task.get(key)
        if report.end_step is not None or lines is None:
            continue
        report.end_step = lines.max_step
        report.exit_reason = report.exit_reason or "ended without an exit record (killed?)"
        mean = lines.mean_step_seconds
        if mean is not None and report.start_step is not None:
            report.step_seconds_max = lines.seconds_max
            report.step_seconds_total = round(mean * (report.end_step - report.start_step), 3)
        if key in job_starts:
            report.allocated_seconds = round(lines.max_time - job_starts[key], 3)


def _count_recomputed_steps(reports: list[TaskReport]) -> None:
    """Steps an earlier task had already done beyond the checkpoint each task resumed from."""
    reached = None  # the furthest step an earlier task ended at
    for report in reports:
        if report.start_step is not None and reached is not None:
            report.recomputed_steps = max(0, reached - report.start_step)
        if report.end_step is not None:
            reached = max(reached or 0, report.end_step)


def _count_useful_seconds(reports: list[TaskReport], saved_step: int | None = None) -> None:
    """Each task's step time, less the share of steps that a later task computed again (or,
    for a last task that was killed, that no checkpoint kept)."""
    for i, report in enumerate(reports):
        if report.start_step is None or report.end_step is None or report.step_seconds_total is None:
            continue
        next_start = next((r.start_step for r in reports[i + 1 :] if r.start_step is not None), None)
        if next_start is None and report.exit_code is None and saved_step is not None:
            next_start = saved_step
        done = report.end_step - report.start_step
        kept = done if next_start is None else max(0, min(report.end_step, next_start) - report.start_step)
        report.useful_seconds = round(report.step_seconds_total * (kept / done), 3) if done else 0.0


def goodput(reports: list[TaskReport]) -> float | None:
    """Useful step time over allocated time, over every task that reported both."""
    counted = [r for r in reports if r.useful_seconds is not None and r.allocated_seconds]
    allocated = sum(r.allocated_seconds for r in counted if r.allocated_seconds)
    if not allocated:
        return None
    return round(sum(r.useful_seconds for r in counted if r.useful_seconds is not None) / allocated, 4)


def required_lead_seconds(reports: list[TaskReport]) -> float | None:
    """The exit_grace the observed steps and saves call for (plus the round of an evaluation a
    stop may arrive in: it is abandoned after that round); None before any save was timed."""
    saves = [r.save_seconds_max for r in reports if r.save_seconds_max]
    steps = [r.step_seconds_max for r in reports if r.step_seconds_max]
    rounds = [r.eval_round_seconds_max for r in reports if r.eval_round_seconds_max]
    if not saves:
        return None
    slowest = max(saves) + max(steps, default=0.0) + max(rounds, default=0.0)
    return round(LEAD_FACTOR * slowest + LEAD_SLACK_SECONDS, 1)


def lead_time_warning(exit_grace: int, reports: list[TaskReport]) -> str | None:
    needed = required_lead_seconds(reports)
    if needed is None or exit_grace >= needed:
        return None
    slowest_save = max(r.save_seconds_max or 0.0 for r in reports)
    slowest_step = max(r.step_seconds_max or 0.0 for r in reports)
    return (
        f"job.exit_grace is {exit_grace}s but the slowest save took {slowest_save:.1f}s and the slowest step "
        f"{slowest_step:.1f}s: set exit_grace to at least {needed:.0f}s, or a time limit may cut a save short"
    )


@dataclass(frozen=True)
class KillWindow:
    """How long Slurm lets a job run after SIGTERM before SIGKILL: ``KillWait`` after a
    scancel or a time limit, plus the partition's ``GraceTime`` when it preempts."""

    kill_wait: int
    grace_time: int
    preempts: bool

    @property
    def preemption_seconds(self) -> int:
        return self.grace_time + self.kill_wait


def kill_window_warning(window: KillWindow | None, reports: list[TaskReport]) -> str | None:
    """A warning when the measured step + save does not fit between SIGTERM and SIGKILL.
    The trainer saves on SIGTERM (and torchrun waits exit_grace for it), but Slurm's own
    SIGKILL cuts a save that is still running."""
    needed = required_lead_seconds(reports)
    if window is None or needed is None:
        return None
    slowest_save = max(r.save_seconds_max or 0.0 for r in reports)
    slowest_step = max(r.step_seconds_max or 0.0 for r in reports)
    measured = (
        f"the slowest save took {slowest_save:.1f}s and the slowest step {slowest_step:.1f}s (needs ~{needed:.0f}s)"
    )
    if window.preempts and window.preemption_seconds < needed:
        return (
            f"a preempted job gets {window.preemption_seconds}s from SIGTERM to SIGKILL (partition GraceTime "
            f"{window.grace_time}s + KillWait {window.kill_wait}s) but {measured}: a preemption will cut the save; "
            "use train.async_save, save more often by steps, or ask the admins for a longer GraceTime"
        )
    if window.kill_wait < needed:
        return (
            f"Slurm's KillWait is {window.kill_wait}s but {measured}: a scancel or a node's SIGTERM will cut the "
            "save (time limits are covered by exit_grace); use train.async_save or ask the admins for a longer "
            "KillWait"
        )
    return None


def run_reports(
    run_dir: Path, time_limit: float | None = None, metrics: MetricsSummary | None = None
) -> list[TaskReport]:
    """The reports of the run in ``run_dir``; ``time_limit`` is its jobs' (job.time, seconds);
    ``metrics`` the summary of its metrics.jsonl when the caller has it already."""
    import time

    from jobgen.runs.rundir import RunDir, complete_checkpoints_in
    from jobgen.runs.summary_cache import summarize

    saved = complete_checkpoints_in(RunDir(run_dir).checkpoints)
    return task_reports(
        read_tasks(run_dir / "tasks.jsonl"),
        metrics if metrics is not None else summarize(run_dir / "metrics.jsonl"),
        time_limit=time_limit,
        now=time.time(),
        saved_step=saved[-1][0] if saved else None,
    )
