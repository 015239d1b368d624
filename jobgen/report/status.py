"""What a run is doing: its jobs' Slurm states plus what the run directory records.

Slurm forgets a job ``MinJobAge`` after it ends (and this project does not assume
slurmdbd/sacct), so the run directory is the durable record: ``jobs.json`` for
submissions, ``metrics.jsonl`` for progress, ``done`` for completion, the switch
files for stops, ``doctor.json`` for node checks.

This module owns ``jobgen status``: reading those records and Slurm's view into a
:class:`RunStatus`, the run's state (:func:`decide_state`, a pure function of what was
read, by the state sets of :mod:`jobgen.slurm.client`), and its text form. :func:`run_status`
gathers first (:mod:`jobgen.report.status_facts`: the records and Slurm's facts), then decides
(:func:`decide_status`, which reads and asks nothing).

The watchdogs' active alerts are shown as warnings, but their state files and where
they live are the watchdogs' business and jobgen does not import ``watchdogs``
(dependencies point one way; ``tests/unit/test_layering.py``). So :func:`run_status` takes
them as a parameter, ``watchdog_alerts``, which the composition root ``jobgen/cli/main.py``
supplies (``watchdogs.notify.run_alerts``); other callers, the watchdogs themselves,
have no use for them and leave it out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from jobgen.base.safe_read import DamagedFile
from jobgen.base.visible import visible
from jobgen.report.status_facts import RunRecords, SlurmFacts, ask_kill_window, ask_slurm, read_run_records

# Gathered in jobgen.report.status_facts; the watchdogs and jobgen.report.first_step import these from here.
from jobgen.report.status_facts import queue_for as queue_for
from jobgen.report.status_facts import remembered_for as remembered_for
from jobgen.report.status_facts import slurm_may_know as slurm_may_know
from jobgen.report.stop_requests import ended_attempts, stale_requests
from jobgen.report.task_table import TaskStatus, build_tasks
from jobgen.runs import quarantine
from jobgen.runs.goodput import KillWindow, goodput, kill_window_warning, lead_time_warning
from jobgen.runs.metrics_summary import MetricsSummary
from jobgen.runs.rundir import RunDir
from jobgen.runs.sweep_runs import point_open, point_problem, slurm_view
from jobgen.slurm import client as slurm
from jobgen.spec.resolved import ResolvedSpec

# What the run's watchdogs alert about right now, one line each (supplied by jobgen/cli/main.py).
WatchdogAlerts = Callable[[ResolvedSpec], list[str]]


@dataclass
class RunStatus:
    run_dir: str
    name: str
    program: str
    state: str  # pending, running, stopped, finished, failed, unknown; unreadable (unreadable_status)
    step: int | None  # the newest step known: max(logged_step, saved_step)
    max_steps: int | None
    # Processes on each node in node order ($SLURM_NODEID), as the spec asks: job.procs_per_node.
    node_procs: list[int] = field(default_factory=list)
    tasks: list[TaskStatus] = field(default_factory=list)
    switches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    goodput: float | None = None
    warnings: list[str] = field(default_factory=list)
    # From the last metrics line and the checkpoints: what the one-line listing shows.
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_seconds: float | None = None  # the steps left at the recent step time (training time only)
    last_checkpoint: str | None = None
    # The metrics line is written every log_every_steps while a save may come between two:
    # the step of the last line (whose loss is shown) and of the newest complete checkpoint.
    logged_step: int | None = None
    saved_step: int | None = None
    last_checkpoint_age_seconds: float | None = None
    # [eval]: the newest evaluation and the best (step, eval_loss; the best from best.json).
    eval_last: dict[str, Any] | None = None
    eval_best: dict[str, Any] | None = None
    # A mixture's tokens drawn so far per source ([[data.sources]]), from the last metrics line.
    source_tokens: dict[str, int] | None = None
    # Nodes the run keeps its tasks off (jobgen.runs.quarantine): node, since, job, reason.
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    # Stop requests whose attempt has ended (jobgen.report.stop_requests): not shown as switches; the
    # status command removes them. Not in the JSON: paths to act on, not the run's state.
    stale_stop_requests: list[str] = field(default_factory=list)
    # Slurm could not be asked (SlurmUnavailable): the note that says so, for callers that act
    # on it (the running watchdog) without reading notes. Not in the JSON, where the note is.
    slurm_unreachable: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["slurm_unreachable"], data["stale_stop_requests"]
        for task, row in zip(self.tasks, data["tasks"]):
            row["slurm_id"] = task.slurm_id
        return data


def decide_state(states: set[str], *, done: bool, failed: bool, doctor_ok: bool | None, switches: set[str]) -> str:
    """The run's state from what run_status read: ``states``, the Slurm states of its tasks (empty
    when no job is known); ``done`` and ``failed``, whether those markers exist; ``doctor_ok``,
    the verdict of a doctor run's ``doctor.json`` (None: not a doctor run, or no verdict yet);
    ``switches``, the switch files set. First match wins:

    ======================================================  ===========
    a task has started (``slurm.JOB_STARTED``)              running
    a task is queued (``slurm.JOB_ACTIVE``), no marker      pending
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
    # A queued task of a finished or failed run only exits (its supervisor cancels them as the
    # run ends; one it could not cancel is no work left to do).
    if states & slurm.JOB_ACTIVE and not failed and not done:
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


def run_status(
    run: RunDir,
    watchdog_alerts: WatchdogAlerts | None = None,
    *,
    queue: list[slurm.QueueEntry] | Exception | None = None,
    details: bool = True,
    ended: bool | None = None,
    conf: dict[str, str] | Exception | None = None,
    remembered: list[slurm.JobRecord] | None = None,
) -> RunStatus:
    """Slurm's view of the run's jobs and what its directory records. ``watchdog_alerts``
    (see the module docstring) adds the watchdogs' active alerts to the warnings.

    ``queue``: what :func:`queue_for` returned (or raised) for many runs at once; None asks
    squeue here. ``details``: also ask for the kill window (one run's view). ``ended`` (default:
    ``details``): also ask Slurm about ended jobs the run directory leaves unexplained, which
    can change a task's state (TIMEOUT, CANCELLED, NODE_FAIL) and so the run's: the listing of
    runs asks too, so that it and one run's view agree; pollers that only wait for a change of
    pending/running leave it out. ``conf``: ``slurm.config()`` (or what it raised) when the
    caller asked once for many runs; ``remembered``: what Slurm remembers of the ended jobs of
    many runs, asked once for all of them (:func:`remembered_for`).

    Gather, then decide: the run directory's records (:func:`read_run_records`), Slurm's
    facts (:func:`ask_slurm`, then the kill window), the watchdogs' alerts; then
    :func:`decide_status` makes the report of them, reading and asking nothing more.
    """
    found = read_run_records(run)
    job = found.spec.run.job
    asked = ask_slurm(run, found.task_records, queue, details if ended is None else ended, conf, remembered)
    name, only = slurm_view(run, job.name)
    tasks = build_tasks(
        run,
        name,
        point_queue(run, asked.queue, only) if only is not None else asked.queue,
        asked.ended,
        found.reports,
        found.task_records,
        job.time,
        slurm_answered=asked.unreachable is None,
    )
    # Only once Slurm has seen a job of the run.
    window = (
        ask_kill_window(found.spec, asked.conf)
        if details and asked.conf is not None and tasks and job.graceful_stop
        else None
    )
    alerts = list(watchdog_alerts(found.spec)) if watchdog_alerts is not None else []
    return decide_status(str(run.path), found, asked, tasks, window, alerts)


def point_queue(run: RunDir, queue: list[slurm.QueueEntry], claimed: set[int]) -> list[slurm.QueueEntry]:
    """A sweep's point's share of the sweep's array: the tasks that claimed it, and while it
    is open the array's tasks that have not started yet (one of them will come to it)."""
    waiting = point_open(run)
    return [
        e
        for e in queue
        if e.job_id in claimed or (waiting and e.state in slurm.JOB_PENDING and e.job_id == e.array_job_id)
    ]


def _source_tokens(value: object) -> dict[str, int] | None:
    """A metrics line's ``source_tokens``, if it is a table of names to counts (a line is input:
    anything else is left out)."""
    if not isinstance(value, dict) or not value:
        return None
    if not all(
        isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0 for k, n in value.items()
    ):
        return None
    return dict(value)


def decide_status(
    run_dir: str,
    found: RunRecords,
    asked: SlurmFacts,
    tasks: list[TaskStatus],
    window: KillWindow | None,
    alerts: list[str],
) -> RunStatus:
    """The status :func:`run_status` reports, from what it gathered; reads and asks nothing."""
    job = found.spec.run.job
    last = found.metrics.last_training or {}
    status = RunStatus(
        run_dir=run_dir,
        name=job.name,
        program=job.program,
        state="unknown",
        step=last.get("step"),
        logged_step=last.get("step"),
        max_steps=found.spec.run.train.max_steps if job.kind.trains else None,
        node_procs=list(found.spec.node_procs),
        tasks=tasks,
        goodput=goodput(found.reports),
        notes=[asked.unreachable] if asked.unreachable else [],
        slurm_unreachable=asked.unreachable,
        loss=last.get("loss"),
        tokens_per_s=last.get("tokens_per_s"),
        source_tokens=_source_tokens(last.get("source_tokens")),
    )
    _progress(status, found)
    _switches(status, found, tasks if asked.unreachable is None else [])
    status.eval_last, status.eval_best = eval_progress(found.metrics, found.best)
    status.warnings = _warnings(found, window, alerts)
    status.quarantined = quarantine.to_json(found.held)
    status.state = decide_state(
        _deciding_states(tasks),
        done=found.done,
        failed=found.failed is not None,
        doctor_ok=found.doctor_ok,
        switches=set(found.switches),
    )
    status.notes += _state_notes(status.state, found.failed, found.switches)
    return status


def _warnings(found: RunRecords, window: KillWindow | None, alerts: list[str]) -> list[str]:
    """The run's warnings, in the order they are shown."""
    job = found.spec.run.job
    held = found.held
    candidates = [
        # Lines that are no records are left out of everything else (run_reports reads them
        # the same way); said once here, with the file, so a hand edit or a program's bad line
        # is found rather than silently changing the numbers.
        found.metrics.warning(),
        found.task_lines.warning(),
        # Without graceful stops no save races a time limit or a SIGKILL: nothing to warn about.
        lead_time_warning(job.exit_grace, found.reports) if job.graceful_stop else None,
        kill_window_warning(window, found.reports),
        *(f"watchdog {alert}" for alert in alerts),
        *(
            f"checkpoint {p.name} was set aside: it failed to load while an older one loaded "
            f"(why: {p / 'broken.json'}); delete it once inspected"
            for p in found.broken
        ),
        f"{found.held_problem}: the nodes it held may be used again" if found.held_problem else None,
        found.best_problem,
        _snapshots_off_warning(found.snapshots_off),
        f"quarantined node(s) {', '.join(held)}: later tasks exclude them "
        f"(jobgen doctor --clear {job.name} releases those that pass)"
        if held
        else None,
    ]
    return [w for w in candidates if w]


def _snapshots_off_warning(record: dict[str, Any] | None) -> str | None:
    """The line that says memory snapshots are off, and why (whose directory), from the
    trainer's record (RunDir.snapshots_off)."""
    if record is None:
        return None
    where = f"job {record['job_id'] if record['job_id'] is not None else '?'}, node {record['node'] or '?'}"
    if record["owner_uid"] is not None and record["owner"]:
        why = (
            f"{record['directory']} belongs to {record['owner']} (uid {record['owner_uid']}), not to you: "
            "remove it, or set the site's paths.snapshot_dir elsewhere"
        )
    else:
        why = record["reason"] or "the snapshot directory could not be made"
    return f"memory snapshots are off ({where}): {why}; a relaunch resumes from the last checkpoint instead"


def _switches(status: RunStatus, found: RunRecords, tasks: list[TaskStatus]) -> None:
    """The switches shown: the files in switches/ less the stop requests of attempts that have
    ended (``tasks``: only when Slurm answered, else a task not in the queue proves nothing)."""
    ended, active = ended_attempts(found.task_records, found.reports, tasks)
    stale = stale_requests(found.stop_requests, ended, active)
    status.stale_stop_requests = [str(p) for p in stale]
    status.switches = [name for name in found.switches if name not in {p.name for p in stale}]


def _state_notes(state: str, failed: dict[str, Any] | None, switches: list[str]) -> list[str]:
    """What the notes add to the state: the failure that stopped the run, a kill switch set."""
    notes = []
    if state == "failed" and failed is not None:  # decided by the failed marker
        notes.append(
            f"stopped after a failure that every task would repeat (exit {failed.get('exit_code')}, "
            f"job {failed.get('job_id')}): {failed.get('reason')}"
        )
        notes.append(f"to continue: {failed.get('fix')}")
    if "kill" in switches and state in {"running", "pending"}:
        notes.append("kill switch set: the run stops at the next step and queued tasks will exit at once")
    return notes


def _deciding_states(tasks: list[TaskStatus]) -> set[str]:
    """The states decide_state weighs: every task Slurm still holds, and how the last one
    that ended ended (a memory-guard stop followed by a good task is no failed run)."""
    active = {t.state for t in tasks if t.state in slurm.JOB_ACTIVE}
    ended = [t for t in tasks if t.state not in slurm.JOB_ACTIVE]
    last = max(ended, key=lambda t: (t.start_time or 0, t.restart, t.job_id), default=None)
    return active | ({last.state} if last else set())


# The recent steps an ETA is taken from: long enough to smooth a save, short enough to follow a change.


def _progress(status: RunStatus, found: RunRecords) -> None:
    """The newest checkpoint's step, name and age, the step (never behind what is saved), and
    the ETA from the recent step time."""
    if found.saved:
        status.saved_step, path = found.saved[-1]
        status.step = max(status.step if status.step is not None else -1, status.saved_step)
        status.last_checkpoint = path.name
        status.last_checkpoint_age_seconds = found.saved_age_seconds
    seconds = found.metrics.eta_step_seconds()  # of the newest training lines
    if status.max_steps and status.step is not None and seconds:
        status.eta_seconds = max(0, status.max_steps - status.step) * sorted(seconds)[len(seconds) // 2]


def eval_progress(
    metrics: MetricsSummary, best: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the newest evaluation, the best one) as {step, eval_loss[, eval_ppl]}: the best is the
    checkpoint ``best.json`` names, else the lowest eval loss logged."""
    if metrics.eval_last is None or metrics.eval_lowest is None:
        return None, None
    last = dict(metrics.eval_last)
    if best is not None and best.get("eval_loss") is not None:
        return last, {"step": best.get("step"), "eval_loss": best["eval_loss"], "checkpoint": best.get("checkpoint")}
    lowest = metrics.eval_lowest
    return last, {"step": lowest["step"], "eval_loss": lowest["eval_loss"], "checkpoint": None}


def unreadable(run: RunDir) -> str | None:
    """Why run_status cannot read this run's records (spec.json, jobs.json), in one line that
    names the file and the JSON or validation error (jobgen.base.safe_read); None when it can. A
    truncated or hand-edited file must not take the status of every other run down with it."""
    try:
        run.load_spec()
        run.jobs()
    except DamagedFile as exc:
        return str(exc)
    except FileNotFoundError as exc:  # removed since the run was found
        return f"{visible(exc.filename)}: gone"
    return point_problem(run)  # a sweep's point: its sweep.json too


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


def watch_run(
    run: RunDir, echo: Callable[[str], None], interval: float = 3.0, watchdog_alerts: WatchdogAlerts | None = None
) -> RunStatus:
    """Print one line whenever the run's state, step or tasks change; return the final status."""
    last = None
    while True:
        current = run_status(run, watchdog_alerts)
        line = watch_line(current)
        if line != last:
            echo(f"{time.strftime('%H:%M:%S')} {line}")
            last = line
        if current.state not in {"pending", "running", "unknown"}:
            return current
        time.sleep(interval)


def watch_line(status: RunStatus) -> str:
    """The watch's line without its clock: state, step (with the logged and the saved one
    when they differ) and one state per task, its latest attempt's (the task table's rows
    are oldest first, so a later row of the same task replaces an earlier one)."""
    line = status.state
    if status.max_steps:
        line += f" step {status.step if status.step is not None else '-'}/{status.max_steps}"
        if status.saved_step is not None and status.saved_step != status.logged_step:
            logged = status.logged_step if status.logged_step is not None else "-"
            line += f" (logged {logged}, saved {status.saved_step})"
    latest = {t.slurm_id: t.state for t in status.tasks}
    return line + "  " + ", ".join(f"{task}:{state}" for task, state in latest.items())
