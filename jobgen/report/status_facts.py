"""What ``jobgen status`` gathers before it decides anything: the run directory's records
(:class:`RunRecords`, each file read once) and Slurm's facts (:class:`SlurmFacts`: its
queue, what it remembers of ended jobs, its configuration and kill window).
:mod:`jobgen.report.status` decides from them, and from nothing else, what to report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobgen.base.safe_read import DamagedFile, as_int, is_int, read_best, read_object
from jobgen.launch.preflight import kill_window
from jobgen.program.trainer_records import trainer_checkpoints
from jobgen.report.task_table import read_task_records, unexplained_submissions
from jobgen.runs import quarantine
from jobgen.runs.goodput import KillWindow, TaskReport, run_reports
from jobgen.runs.jsonl_records import Records, read_tasks
from jobgen.runs.metrics_summary import MetricsSummary
from jobgen.runs.rundir import RunDir
from jobgen.runs.summary_cache import summarize
from jobgen.runs.sweep_runs import slurm_view, sweep_jobs
from jobgen.slurm import client as slurm
from jobgen.spec.resolved import ResolvedSpec


def slurm_may_know(
    run: RunDir, queue: list[slurm.QueueEntry], records: dict, conf: dict[str, str], now: float | None = None
) -> list[int]:
    """The submissions worth asking Slurm about after they ended: every one where accounting
    keeps jobs (one sacct call); else those the run directory leaves unexplained, and those
    with a task that ended within MinJobAge (Slurm still knows how it ended: CANCELLED,
    TIMEOUT, NODE_FAIL), one ``scontrol show job`` each."""
    subs = [int(j["job_id"]) for j in run.jobs() if not j.get("local")]
    if slurm.accounting_enabled(conf):
        return subs
    memory = slurm.parse_seconds(conf.get("MinJobAge", "")) or 300
    now = time.time() if now is None else now
    recent = {
        int(r.get("array_job_id") or job)
        for (job, _), r in records.items()
        if r.get("end") is None or now - float(r["end"]) < memory
    }
    unexplained = set(unexplained_submissions(run, queue, records))
    return [s for s in subs if s in recent or s in unexplained]


def queue_for(runs: list[RunDir]) -> list[slurm.QueueEntry]:
    """One ``squeue`` for every submission of these runs, and for a sweep's point the tasks
    that claimed it (raises SlurmUnavailable)."""
    ids = {int(j["job_id"]) for run in runs for j in run.jobs() if not j.get("local")}
    for run in runs:
        ids |= (slurm_view(run, "")[1] or set()) | set(sweep_jobs(run))
    return slurm.queue(sorted(ids)) if ids else []


@dataclass
class RunRecords:
    """What :func:`jobgen.report.status.run_status` reads from the run directory, each file once,
    before anything is decided."""

    spec: ResolvedSpec
    metrics: MetricsSummary  # metrics.jsonl: training steps and evaluations, summarised
    task_lines: Records  # tasks.jsonl, for its warning (run_reports reads it into the reports)
    switches: list[str]
    stop_requests: list[tuple[Path, str, int | None]]  # RunDir.stop_requests
    task_records: dict[tuple[int, int], dict[str, Any]]  # the batch script's record of each attempt
    reports: list[TaskReport]
    best: dict[str, Any] | None
    best_problem: str | None  # why best.json could not be read
    saved: list[tuple[int, Path]]  # complete checkpoints, oldest first
    saved_age_seconds: float | None  # of the newest one; None when its time cannot be read
    broken: list[Path]  # checkpoints set aside
    held: dict[str, quarantine.Quarantined]
    held_problem: str | None  # why quarantine.json could not be read
    failed: dict[str, Any] | None  # the failed marker
    done: bool
    doctor_ok: bool | None  # doctor.json's verdict, for a doctor run that has one
    # Why the newest attempt that refused its memory snapshots' directory took none (RunDir.snapshots_off).
    snapshots_off: dict[str, Any] | None = None


@dataclass
class SlurmFacts:
    """What :func:`jobgen.report.status.run_status` learns from Slurm: its queue, what it remembers
    of ended jobs and its configuration (None: not asked); or why it could not be asked."""

    queue: list[slurm.QueueEntry]
    ended: list[slurm.JobRecord]
    conf: dict[str, str] | None
    unreachable: str | None


def read_run_records(run: RunDir) -> RunRecords:
    """Everything :func:`jobgen.report.status.run_status` needs from the run directory."""
    spec = run.load_spec()
    job = spec.run.job
    saved = run.complete_checkpoints()
    if job.kind.own_checkpoints:  # a Hugging Face Trainer's checkpoint-N/ count as saved too
        saved = sorted(saved + trainer_checkpoints(run.checkpoints))
    held, held_problem = _read_quarantine(run)
    best, best_problem = _read_best(run)
    metrics = summarize(run.metrics)
    return RunRecords(
        spec=spec,
        metrics=metrics,
        task_lines=read_tasks(run.path / "tasks.jsonl"),
        switches=sorted(p.name for p in run.switches.iterdir()) if run.switches.is_dir() else [],
        stop_requests=run.stop_requests(),
        task_records=read_task_records(run),
        reports=run_reports(run.path, job.time, metrics),
        best=best,
        best_problem=best_problem,
        saved=saved,
        saved_age_seconds=_checkpoint_age(saved[-1][1]) if saved else None,
        broken=run.broken_checkpoints(),
        held=held,
        held_problem=held_problem,
        failed=run.failure(),
        done=run.done_marker.exists(),
        doctor_ok=_doctor_verdict(run) if job.kind.checks_nodes else None,
        snapshots_off=_snapshots_off(run) if job.kind.trains else None,
    )


def _snapshots_off(run: RunDir) -> dict[str, Any] | None:
    """The newest attempt's record of memory snapshots turned off (the trainer writes one where
    the snapshot directory on the tmpfs is someone else's), its fields of the right types only."""
    found = []
    for path in run.snapshots_off_records():
        try:
            record = read_object(path, "a record of memory snapshots turned off")
        except (DamagedFile, FileNotFoundError):
            continue
        if record is None:
            continue
        fields = {
            key: record.get(key) if isinstance(record.get(key), str) else None
            for key in ("node", "directory", "owner", "reason")
        }
        fields["owner_uid"] = record.get("owner_uid") if is_int(record.get("owner_uid")) else None
        fields["job_id"], fields["restart"] = as_int(record.get("job_id")), as_int(record.get("restart")) or 0
        found.append(((fields["job_id"] or -1, fields["restart"]), fields))
    return max(found, key=lambda item: item[0])[1] if found else None


def _read_best(run: RunDir) -> tuple[dict[str, Any] | None, str | None]:
    """best.json, or None and why it cannot be read (a warning: the rest is still shown)."""
    try:
        return read_best(run.best_checkpoint), None
    except DamagedFile as exc:
        return None, f"{exc}: the best eval loss shown is the lowest logged (the trainer writes the file again)"


def _doctor_verdict(run: RunDir) -> bool | None:
    """doctor.json's verdict (its "ok"); None without one, or when it cannot be read."""
    try:
        report = read_object(run.path / "doctor.json", "a doctor report")
    except DamagedFile:
        return None
    return bool(report.get("ok")) if report is not None else None


def _checkpoint_age(path: Path) -> float | None:
    """Seconds since the checkpoint was completed (its trainer_state.json written)."""
    marker = path / "trainer_state.json"
    try:
        return max(0.0, time.time() - (marker if marker.exists() else path).stat().st_mtime)
    except OSError:
        return None


def _read_quarantine(run: RunDir) -> tuple[dict[str, quarantine.Quarantined], str | None]:
    """The nodes the run holds in quarantine, or none and why quarantine.json cannot be read."""
    try:
        return quarantine.read(run), None
    except quarantine.QuarantineError as exc:
        return {}, str(exc)
    except OSError as exc:
        return {}, f"{run.quarantine} is unreadable ({exc})"


def remembered_for(
    runs: list[RunDir], queue: list[slurm.QueueEntry], conf: dict[str, str] | None
) -> list[slurm.JobRecord]:
    """What Slurm remembers of the ended jobs of all these runs, asked once for all of them
    (one ``sacct``, or without accounting one ``scontrol show job``): a listing of a thousand
    runs costs one call, not one per run. :func:`ask_slurm` takes each run's share of it."""
    if conf is None:
        return []
    ids = sorted({i for run in runs if run.jobs() for i in slurm_may_know(run, queue, read_task_records(run), conf)})
    return slurm.ended_jobs(ids, accounting=slurm.accounting_enabled(conf)) if ids else []


def ask_slurm(
    run: RunDir,
    task_records: dict,
    queue: list[slurm.QueueEntry] | Exception | None,
    ended: bool,
    conf: dict[str, str] | Exception | None = None,
    remembered: list[slurm.JobRecord] | None = None,
) -> SlurmFacts:
    """Slurm's queue (``queue`` when the caller asked for many runs at once) and, with
    ``ended``, its configuration (``conf`` when the caller asked once for many runs) and what
    it remembers of the run's ended jobs (taken from ``remembered`` when the caller asked once
    for many runs: :func:`remembered_for`). Slurm out of reach is a fact too: an empty queue
    and the note that says so."""
    known: list[slurm.JobRecord] = []
    try:
        if queue is None:
            queue = queue_for([run])
        if isinstance(queue, Exception):
            raise queue
        if isinstance(conf, Exception):
            raise conf
        if ended and run.jobs():
            conf = conf if conf is not None else slurm.config()
            ask = slurm_may_know(run, queue, task_records, conf)
            if ask and remembered is not None:
                asked = set(ask)
                known = [r for r in remembered if r.job_id in asked or r.array_job_id in asked]
            elif ask:
                known = slurm.ended_jobs(ask, accounting=slurm.accounting_enabled(conf))
    except slurm.SlurmUnavailable as exc:
        unreachable = f"Slurm not reachable ({exc.reason or exc}): showing what the run directory records"
        return SlurmFacts([], known, None, unreachable)
    return SlurmFacts(queue, known, conf if isinstance(conf, dict) else None, None)


def ask_kill_window(spec: ResolvedSpec, conf: dict[str, str]) -> KillWindow | None:
    """Slurm's SIGTERM-to-SIGKILL window for the run's partition (jobgen.launch.preflight.kill_window);
    None when Slurm does not say or cannot be asked."""
    try:
        return kill_window(spec, conf)
    except slurm.SlurmError:
        return None
