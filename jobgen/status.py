"""What a run is doing: its jobs' Slurm states plus what the run directory records.

Slurm forgets a job ``MinJobAge`` after it ends (and this project does not assume
slurmdbd/sacct), so the run directory is the durable record: ``jobs.json`` for
submissions, ``metrics.jsonl`` for progress, ``done`` for completion, the switch
files for stops, ``doctor.json`` for node checks.

This module owns ``jobgen status``: reading those records and Slurm's view into a
:class:`RunStatus`, the run's state (:func:`decide_state`, a pure function of what was
read, by the state sets of :mod:`jobgen.slurm`), and its text form.

The watchdogs' active alerts are shown as warnings, but their state files and where
they live are the watchdogs' business and jobgen does not import ``watchdogs``
(dependencies point one way; ``tests/test_layering.py``). So :func:`run_status` takes
them as a parameter, ``watchdog_alerts``, which the composition root ``jobgen/cli.py``
supplies (``watchdogs.notify.run_alerts``); other callers, the watchdogs themselves,
have no use for them and leave it out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from jobgen import slurm
from jobgen.goodput import TaskReport, goodput, kill_window_warning, lead_time_warning, read_jsonl, run_reports
from jobgen.loader import ResolvedSpec
from jobgen.preflight import kill_window
from jobgen.rundir import RunDir

# What the run's watchdogs alert about right now, one line each (supplied by jobgen/cli.py).
WatchdogAlerts = Callable[[ResolvedSpec], list[str]]


@dataclass
class TaskStatus:
    job_id: int
    array_job_id: int
    array_task: str
    state: str
    exit_code: str | None = None
    reason: str | None = None
    nodes: str | None = None
    # From the trainer's own records (jobgen.goodput); None for tasks that did not train.
    start_step: int | None = None
    end_step: int | None = None
    recomputed_steps: int | None = None
    seconds_to_first_step: float | None = None
    exit_reason: str | None = None
    restart: int = 0


@dataclass
class RunStatus:
    run_dir: str
    name: str
    program: str
    state: str  # pending, running, stopped, finished, failed, unknown; unreadable (unreadable_status)
    step: int | None
    max_steps: int | None
    tasks: list[TaskStatus] = field(default_factory=list)
    switches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    goodput: float | None = None
    warnings: list[str] = field(default_factory=list)
    # Slurm could not be asked (SlurmUnavailable): the note that says so, for callers that act
    # on it (the running watchdog) without reading notes. Not in the JSON, where the note is.
    slurm_unreachable: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["slurm_unreachable"]
        return data


def _tasks(run: RunDir, name: str) -> list[TaskStatus]:
    """Every array task Slurm still knows of, queued ones from squeue and recently
    ended ones from scontrol; submissions it forgot keep their last known state."""
    # Keyed by (array id, task index): pending tasks have no job id of their own yet.
    tasks: dict[tuple[int, str], TaskStatus] = {}
    submissions = [j for j in run.jobs() if not j.get("local")]
    # Job ids are only unique on one controller's lifetime: a name check keeps a recycled
    # id (a rebuilt cluster, a wiped state dir) from passing another job off as ours.
    for entry in slurm.queue([j["job_id"] for j in submissions]) if submissions else []:
        if entry.name != name:
            continue
        tasks[(entry.array_job_id, entry.array_task)] = TaskStatus(
            entry.job_id, entry.array_job_id, entry.array_task, entry.state, reason=entry.reason, nodes=entry.nodes
        )
    for sub in submissions:
        for record in slurm.show_job(sub["job_id"]):
            job_id = int(record.get("JobId", "0") or 0)
            array_job = record.get("ArrayJobId", "")
            key = (int(array_job) if array_job.isdigit() else job_id, record.get("ArrayTaskId", "N/A"))
            if record.get("JobName") != name:
                continue
            if job_id and key not in tasks and "-" not in key[1]:  # "2-3%1": the still-pending rest
                tasks[key] = TaskStatus(
                    job_id,
                    key[0],
                    key[1],
                    record.get("JobState", "UNKNOWN"),
                    exit_code=record.get("ExitCode"),
                    reason=record.get("Reason"),
                    nodes=record.get("NodeList"),
                )
        known = {t.job_id for t in tasks.values()} | {t.array_job_id for t in tasks.values()}
        if sub["job_id"] not in known:
            # Ended longer ago than Slurm's MinJobAge: only the run directory remembers it.
            tasks[(sub["job_id"], "N/A")] = TaskStatus(sub["job_id"], sub["job_id"], "N/A", "ENDED")
    return sorted(tasks.values(), key=lambda t: (t.array_job_id, t.job_id, t.array_task))


def _merge_reports(tasks: list[TaskStatus], reports: list[TaskReport]) -> None:
    """Attach the trainer's records to Slurm's tasks. Earlier runs of a requeued job, and
    jobs Slurm has forgotten (MinJobAge) or never knew (--local), get entries of their own."""
    latest: dict[str, int] = {}
    for report in reports:
        latest[report.job_id] = max(latest.get(report.job_id, 0), report.restart)
    from_slurm = {str(t.job_id): t for t in tasks}
    for report in reports:
        if not report.job_id.isdigit():
            continue  # a run by hand outside Slurm
        is_latest = report.restart == latest[report.job_id]
        task = from_slurm.get(report.job_id) if is_latest else None
        if task is None:
            base = from_slurm.get(report.job_id)
            job_id = int(report.job_id)
            task = TaskStatus(
                job_id,
                base.array_job_id if base else job_id,
                base.array_task if base else "N/A",
                "ENDED" if is_latest else "REQUEUED",
            )
            tasks.append(task)
        task.restart = report.restart
        task.start_step, task.end_step = report.start_step, report.end_step
        task.recomputed_steps = report.recomputed_steps
        task.seconds_to_first_step = report.seconds_to_first_step
        task.exit_reason = report.exit_reason
    tasks.sort(key=lambda t: (t.array_job_id, t.job_id, t.restart, t.array_task))


def decide_state(states: set[str], *, done: bool, failed: bool, doctor_ok: bool | None, switches: set[str]) -> str:
    """The run's state from what run_status read: ``states``, the Slurm states of its tasks (empty
    when no job is known); ``done`` and ``failed``, whether those markers exist; ``doctor_ok``,
    the verdict of a doctor run's ``doctor.json`` (None: not a doctor run, or no verdict yet);
    ``switches``, the switch files set. First match wins:

    ======================================================  ===========
    a task has started (``slurm.JOB_STARTED``)              running
    a task is queued (``slurm.JOB_ACTIVE``), no ``failed``  pending
    ``done``                                                finished
    ``failed`` (a failure every task would repeat)          failed
    a doctor verdict                                        finished if ok, else failed
    ``kill`` or ``abort`` switch                            stopped
    a task failed (``slurm.JOB_FAILED``)                    failed
    any task known                                          stopped
    nothing known                                           unknown
    ======================================================  ===========
    """
    if states & slurm.JOB_STARTED:
        return "running"
    if states & slurm.JOB_ACTIVE and not failed:
        return "pending"
    if done:
        return "finished"
    if failed:
        return "failed"
    if doctor_ok is not None:
        return "finished" if doctor_ok else "failed"
    if {"kill", "abort"} & switches:
        return "stopped"
    if states & slurm.JOB_FAILED:
        return "failed"
    if states:
        return "stopped"
    return "unknown"


def run_status(run: RunDir, watchdog_alerts: WatchdogAlerts | None = None) -> RunStatus:
    """Slurm's view of the run's jobs and what its directory records. ``watchdog_alerts``
    (see the module docstring) adds the watchdogs' active alerts to the warnings."""
    spec = run.load_spec()
    job = spec.run.job
    lines = read_jsonl(run.path / "metrics.jsonl")
    metrics = lines[-1] if lines else None
    switches = sorted(p.name for p in run.switches.iterdir()) if run.switches.is_dir() else []
    notes = []
    unreachable = None
    try:
        tasks = _tasks(run, job.name)
    except slurm.SlurmUnavailable as exc:
        tasks = []
        unreachable = (
            f"Slurm not reachable ({exc.stderr.splitlines()[-1] if exc.stderr else exc}): "
            "showing what the run directory records"
        )
        notes.append(unreachable)
    reports = run_reports(run.path, spec.run.job.time)
    _merge_reports(tasks, reports)
    states = {t.state for t in tasks}
    status = RunStatus(
        run_dir=str(run.path),
        name=job.name,
        program=job.program,
        state="unknown",
        step=metrics.get("step") if metrics else None,
        max_steps=spec.run.train.max_steps if job.program == "train" else None,
        tasks=tasks,
        switches=switches,
        goodput=goodput(reports),
        notes=notes,
        slurm_unreachable=unreachable,
    )
    # Without graceful stops no save races a time limit or a SIGKILL: nothing to warn about.
    warning = lead_time_warning(job.exit_grace, reports) if job.graceful_stop else None
    if warning:
        status.warnings.append(warning)
    try:
        # Only once Slurm has seen a job of the run.
        window = kill_window(spec) if tasks and job.graceful_stop else None
    except slurm.SlurmError:
        window = None
    warning = kill_window_warning(window, reports)
    if warning:
        status.warnings.append(warning)
    if watchdog_alerts is not None:
        status.warnings.extend(f"watchdog {alert}" for alert in watchdog_alerts(spec))
    status.warnings.extend(
        f"checkpoint {p.name} was set aside: it failed to load while an older one loaded (why: {p / 'broken.json'}); "
        "delete it once inspected"
        for p in run.broken_checkpoints()
    )
    failed = run.failure()
    doctor = run.path / "doctor.json"
    doctor_ok = bool(json.loads(doctor.read_text()).get("ok")) if job.program == "doctor" and doctor.is_file() else None
    status.state = decide_state(
        states, done=run.done_marker.exists(), failed=failed is not None, doctor_ok=doctor_ok, switches=set(switches)
    )
    if status.state == "failed" and failed is not None:  # decided by the failed marker
        status.notes.append(
            f"stopped after a failure that every task would repeat (exit {failed.get('exit_code')}, "
            f"job {failed.get('job_id')}): {failed.get('reason')}"
        )
        status.notes.append(f"to continue: {failed.get('fix')}")
    if "kill" in switches and status.state in {"running", "pending"}:
        status.notes.append("kill switch set: the run stops at the next step and queued tasks will exit at once")
    return status


def unreadable(run: RunDir) -> str | None:
    """Why run_status cannot read this run's records (spec.json, jobs.json), in one line that
    names the file and the JSON or validation error; None when it can. A truncated or
    hand-edited file must not take the status of every other run down with it."""
    from pydantic import ValidationError

    from jobgen.loader import key_path
    from jobgen.site import SiteProfile
    from jobgen.spec import RunSpec

    def read(path):
        try:
            return json.loads(path.read_bytes())
        except OSError as exc:
            raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: invalid JSON: {exc}") from None

    try:
        data = read(run.spec_file)
        jobs = read(run.jobs_file) if run.jobs_file.exists() else []
    except ValueError as exc:
        return str(exc)
    if not isinstance(data, dict) or not isinstance(data.get("run"), dict) or not isinstance(data.get("site"), dict):
        return f"{run.spec_file}: not a jobgen spec (an object with the objects 'run' and 'site')"
    for part, model in (("run", RunSpec), ("site", SiteProfile)):
        try:
            model.model_validate(data[part])
        except ValidationError as exc:
            first, more = exc.errors()[0], len(exc.errors()) - 1
            where = ".".join(filter(None, (part, key_path(first["loc"]))))
            message = str(first["msg"]).removeprefix("Value error, ")
            return f"{run.spec_file}: {where}: {message}" + (f" (and {more} more)" if more else "")
    if not isinstance(jobs, list) or not all(isinstance(j, dict) and isinstance(j.get("job_id"), int) for j in jobs):
        return f"{run.jobs_file}: not a list of submissions (objects with an integer 'job_id')"
    return None


def unreadable_status(run: RunDir, problem: str) -> RunStatus:
    """The entry of a run that ``unreadable`` refused, so a listing still shows it."""
    return RunStatus(
        run_dir=str(run.path),
        name=run.path.name,
        program="unknown",
        state="unreadable",
        step=None,
        max_steps=None,
        warnings=[problem],
    )


def format_status(status: RunStatus) -> str:
    lines = [
        f"run      {status.name}  ({status.program})",
        f"dir      {status.run_dir}",
        f"state    {status.state}",
    ]
    if status.max_steps is not None:
        lines.append(f"step     {status.step if status.step is not None else '-'} / {status.max_steps}")
    if status.goodput is not None:
        lines.append(f"goodput  {status.goodput:.1%} (time in steps that were kept / time the jobs held)")
    if status.switches:
        lines.append(f"switches {', '.join(status.switches)}")
    if status.tasks:
        lines.append("")
        lines.append(
            f"{'job id':>8}  {'task':<6} {'state':<10} {'exit':<6} {'steps':<11} {'redone':>6} "
            f"{'1st step':>8}  {'nodes / reason'}"
        )
        for t in status.tasks:
            nodes = t.nodes if t.nodes not in (None, "", "(null)") else None
            reason = t.reason if t.reason not in (None, "None") else None
            detail = (nodes or reason) if t.state not in slurm.JOB_PENDING else (reason or "")
            if t.exit_reason:
                detail = f"{detail or ''}  {t.exit_reason}".strip()
            steps = f"{t.start_step}->{t.end_step}" if t.start_step is not None else ""
            redone = "" if t.recomputed_steps is None or t.start_step is None else str(t.recomputed_steps)
            first = f"{t.seconds_to_first_step:.0f}s" if t.seconds_to_first_step is not None else ""
            lines.append(
                f"{t.job_id:>8}  {t.array_task:<6} {t.state:<10} {t.exit_code or '':<6} {steps:<11} "
                f"{redone:>6} {first:>8}  {detail or ''}"
            )
    lines.extend(f"note     {n}" for n in status.notes)
    lines.extend(f"WARNING  {w}" for w in status.warnings)
    return "\n".join(lines)


def watch_run(
    run: RunDir, echo: Callable[[str], None], interval: float = 3.0, watchdog_alerts: WatchdogAlerts | None = None
) -> RunStatus:
    """Print one line whenever the run's state, step or tasks change; return the final status."""
    last = None
    while True:
        current = run_status(run, watchdog_alerts)
        line = (
            f"{time.strftime('%H:%M:%S')} {current.state}"
            + (f" step {current.step}/{current.max_steps}" if current.max_steps else "")
            + "  "
            + ", ".join(f"{t.job_id}:{t.state}" for t in current.tasks)
        )
        if line.split(" ", 1)[1] != (last or " ").split(" ", 1)[1]:
            echo(line)
            last = line
        if current.state not in {"pending", "running", "unknown"}:
            return current
        time.sleep(interval)
