"""The run's records of progress, one implementation for the bundled trainer and for a
user's own program (:mod:`jobgen.runtime`): one JSON line per logging step in
``metrics.jsonl``, a line per array task's first step and exit in ``tasks.jsonl``, a
summary in ``metrics.json``. ``jobgen status``, goodput, the lead-time check, ``jobgen
plot`` and the hang watchdog read them (jobgen.runs.goodput).

Only rank 0 writes. ``metrics.jsonl`` and ``tasks.jsonl`` are append-only, each line
flushed and fsynced (a reader tolerates a cut last line); ``metrics.json`` is replaced
atomically.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jobgen.base.atomic import write_json_atomic, write_text_atomic
from jobgen.base.exit_codes import ExitCode
from jobgen.runs.rundir import RunDir
from jobgen.runs.summary_cache import summarize

# The fields of a ``metrics.jsonl`` line that jobgen itself writes and its readers trust
# (status, plot, goodput, the hang watchdog, the eval split): a user's metric never
# replaces one. MetricsWriter stamps the first three; a step's line gets the rest from
# the trainer or :meth:`jobgen.runtime.Life.step_done`.
STAMP_FIELDS = ("time", "job_id", "restart")
SYSTEM_FIELDS = frozenset((*STAMP_FIELDS, "step", "step_seconds", "event"))
USER_PREFIX = "user/"


def user_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """A user's numeric metrics as they go into a step's line: one named like a system
    field is kept as ``user/<name>``. Renamed, not refused: a refusal would crash a
    training loop hours in over a logging name the user may not even have chosen (a
    Trainer's or a library's logs); the value still reaches ``metrics.jsonl``."""
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    kept = {k: v for k, v in numeric.items() if k not in SYSTEM_FIELDS}
    for key in SYSTEM_FIELDS & numeric.keys():
        kept.setdefault(USER_PREFIX + key, numeric[key])  # an explicit user/<name> wins
    return kept


# Bytes the exit record keeps from a job's start (reserve_exit_code): on a full disk the
# record is written into them in place, which needs no new block, so the batch script (and
# the job's comment) still learn why the job ended.
EXIT_RECORD_RESERVE = 4096
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def reserve_exit_code(run: RunDir, job_id: str, restart: int) -> None:
    """Keep room for this attempt's exit record while there is room: blank lines, which the
    batch script reads as no record."""
    write_text_atomic(run.exit_code_file(job_id, restart), "\n" * EXIT_RECORD_RESERVE)


def write_exit_code(run: RunDir, job_id: str, restart: int, code: ExitCode, reason: str) -> None:
    """This attempt's exit code and its reason on one line, for the batch script: it exits
    with the one (0 for planned stops) and sets the job's Slurm comment to the other. On a
    full disk, into the room reserve_exit_code kept."""
    words = " ".join((reason or code.reason).split())[:400]
    path = run.exit_code_file(job_id, restart)
    text = f"{int(code)}\n{words}\n"
    try:
        write_text_atomic(path, text)
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS or not path.is_file():
            raise
        fd = os.open(path, os.O_WRONLY)  # the reserved blocks: overwriting them needs no new one
        try:
            room = os.fstat(fd).st_size
            data = text.encode()[:room]
            os.pwrite(fd, data + b"\n" * (room - len(data)), 0)
            os.fsync(fd)
        finally:
            os.close(fd)


def record_failure(
    run: RunDir,
    job_id: str | None,
    restart: int,
    code: ExitCode,
    reason: str,
    repeated: CrashSignature | None = None,
    *,
    at_once: bool = False,
) -> str:
    """Rank 0 of a program that cannot go on: the exit record for the batch script and, for a
    failure every later task would repeat (``code.repeats``, or a crash that ``repeated`` the
    previous task's: :func:`attempt_ended`), the ``failed`` marker that keeps the queued tasks
    from starting (the bundled trainer's rule, trainer.__main__). ``at_once``: ``repeated`` is
    this task's own crash, one that every task would meet (the trainer's crash building the
    model, of the code rather than the machine). Returns the reason recorded."""
    if repeated is not None and at_once:
        reason = f"crashed {repeated.describe()}, as every task would: {reason}"
    elif repeated is not None:
        reason = f"crashed twice the same way {repeated.describe()}: {reason}"
    if job_id:
        write_exit_code(run, job_id, restart, code, reason)
    if code.repeats or repeated is not None:
        run.mark_failed(code, reason, code.fix or REPEATED_CRASH_FIX, job_id, restart)
    return reason


# ---------------------------------------------------------------- a crash that repeats

REPEATED_CRASH_FIX = (
    "find the cause in the traceback (jobgen logs RUN), change what it names, then `jobgen submit` the run again"
)


@dataclass(frozen=True)
class CrashSignature:
    """How a process crashed: the exception's type, where it was raised (the innermost frame of
    its traceback) and the step the run had reached (None before its first step). Two tasks in
    a row that crash with one signature met a failure every later task would meet too."""

    type: str
    where: str
    step: int | None

    @classmethod
    def of(cls, exc: BaseException, step: int | None) -> CrashSignature:
        frame = exc.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        where = "?"
        if frame is not None:
            code = frame.tb_frame.f_code
            where = f"{code.co_filename}:{frame.tb_lineno} in {code.co_name}"
        return cls(f"{type(exc).__module__}.{type(exc).__qualname__}", where, step)

    @classmethod
    def from_json(cls, value: Any) -> CrashSignature | None:
        """A signature as attempt.json holds it; None for anything else (a file on disk is input)."""
        if not isinstance(value, dict) or not all(isinstance(value.get(key), str) for key in ("type", "where")):
            return None
        step = value.get("step")
        whole = isinstance(step, int) and not isinstance(step, bool)
        return cls(value["type"], value["where"], step if whole else None)

    def describe(self) -> str:
        """``at step 7 (ValueError at loop.py:300 in step)``, for the failed marker and status."""
        at = f"at step {self.step}" if self.step is not None else "before its first step"
        file, _, rest = self.where.rpartition(":")
        return f"{at} ({self.type.rsplit('.', 1)[-1]} at {os.path.basename(file)}:{rest})"


def _attempt_file(run: RunDir) -> Path:
    """The last attempt of the run's program: who, whether it ended, and how it crashed."""
    return run.logs / "attempt.json"


def _last_attempt(run: RunDir) -> dict[str, Any]:
    try:
        value = json.loads(_attempt_file(run).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def attempt_started(run: RunDir, job_id: str, restart: int, array_job_id: str | None, launch: int = 0) -> None:
    """Rank 0 of a program that is about to run (past its start checks, holding the writer
    lease): this attempt started, and the crash it would repeat: the previous attempt's, when
    that one ended in a crash and was either another task of this submission (the same array
    job, so a resubmission starts afresh; a requeued job keeps its id: an earlier attempt of
    this job does not count) or an earlier launch of this very attempt, which the batch script
    relaunched inside the task (``launch``, job.in_job_restarts). An attempt that never ended
    (killed) leaves none."""
    last = _last_attempt(run)
    other_task = last.get("job_id") not in (None, job_id) and last.get("array_job_id") == array_job_id
    earlier_launch = (last.get("job_id"), last.get("restart")) == (job_id, restart) and _launch(last) < launch
    previous = last.get("crash") if last.get("ended") is True and (other_task or earlier_launch) else None
    record = {"job_id": job_id, "restart": restart, "launch": launch, "array_job_id": array_job_id, "ended": False}
    write_json_atomic(_attempt_file(run), {**record, "previous_crash": previous})


def _launch(record: dict[str, Any]) -> int:
    """The launch an attempt record names (0 in records written before launches were counted)."""
    launch = record.get("launch", 0)
    return launch if isinstance(launch, int) and not isinstance(launch, bool) else 0


def attempt_ended(
    run: RunDir, job_id: str, restart: int, array_job_id: str | None, crash: CrashSignature | None, launch: int = 0
) -> CrashSignature | None:
    """Rank 0, as an attempt that :func:`attempt_started` ends, crashed (``crash``) or not:
    records how, and returns ``crash`` when the previous task of the run crashed exactly so (the
    run must stop: at most one more task was spent on it), else None."""
    last = _last_attempt(run)
    mine = (last.get("job_id"), last.get("restart"), _launch(last)) == (job_id, restart, launch)
    mine = mine and last.get("ended") is False
    repeated = crash is not None and mine and CrashSignature.from_json(last.get("previous_crash")) == crash
    record = {"job_id": job_id, "restart": restart, "launch": launch, "array_job_id": array_job_id, "ended": True}
    write_json_atomic(_attempt_file(run), {**record, "crash": asdict(crash) if crash else None})
    return crash if repeated else None


def disk_full(exc: BaseException) -> OSError | None:
    """The no-space (or quota) error behind ``exc``, however wrapped: causes, contexts, and the
    per-rank failures of torch.distributed.checkpoint's CheckpointException."""
    pending, seen = [exc], set()
    while pending:
        error = pending.pop()
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return error
        pending += [error.__cause__, error.__context__]
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):  # rank -> (exception, traceback)
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def mount_point(path: str | os.PathLike[str]) -> str:
    """The mount point of the filesystem ``path`` is (or would be) on."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        current = os.path.dirname(current)
    while not os.path.ismount(current):
        current = os.path.dirname(current)
    return current


def crash_reason(exc: BaseException, run_dir: str | os.PathLike[str] | None = None) -> str:
    """The exit reason of a crash: for a full disk, which filesystem and what was being
    written (the rank's own log may be on that disk and lose the traceback), else the
    exception in one line. A write that names no file (a checkpoint writer's) is taken to be
    the run directory's (``run_dir``), where everything a job writes goes."""
    full = disk_full(exc)
    if full is not None:
        if full.filename:
            where = f"{mount_point(full.filename)} (writing {full.filename})"
        elif run_dir is not None:
            where = f"{mount_point(run_dir)} (writing under {run_dir})"
        else:
            where = "a filesystem"
        return f"crashed: no space left on {where}: {full.strerror or 'No space left on device'}"
    return f"crashed: {type(exc).__name__}: {str(exc)[:300]}"


# How often the writer brings the summary of metrics.jsonl up to date itself
# (jobgen.runs.summary_cache): a run nobody looked at for a week still answers status at once,
# since the readers then fold only the lines of the last minutes.
SUMMARY_EVERY_SECONDS = 600.0
# At most this long between fsyncs of metrics.jsonl (MetricsWriter.log_step).
METRICS_SYNC_SECONDS = 5.0


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self._summarized = time.monotonic()
        self._synced = -math.inf  # the first line is synced
        self._unsynced = False
        self._summarizing: threading.Thread | None = None
        self.job_id = os.environ.get("SLURM_JOB_ID")
        # A requeued job keeps its id; the restart count tells its runs apart, and the batch
        # script's launch count its relaunches inside one run (job.in_job_restarts).
        self.restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.launch = int(os.environ.get("JOBGEN_LAUNCH") or 0)
        # Records name the launch only when there was a relaunch: a task's first launch reads
        # as it always did.
        self.stamp = {"job_id": self.job_id, "restart": self.restart} | ({"launch": self.launch} if self.launch else {})
        # Slurm's name of the task (ARRAY_TASK), for status after Slurm forgot the job.
        self.array = {
            "array_job_id": os.environ.get("SLURM_ARRAY_JOB_ID"),
            "array_task": os.environ.get("SLURM_ARRAY_TASK_ID"),
        }

    def _append(self, name: str, record: dict[str, Any], *, sync: bool = True) -> None:
        if not self.enabled:
            return
        # Opened and closed for each line: NFS shows a line to other nodes' readers on close.
        with (self.run_dir / name).open("a") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
            fh.flush()
            if sync:
                os.fsync(fh.fileno())

    def log_step(self, record: dict[str, Any]) -> None:
        # The stamp comes last: whatever ``record`` holds, these are the writer's own.
        # A step's line is fsynced at most every METRICS_SYNC_SECONDS, not at every step: it
        # costs the step loop's critical path each time, and a line lost with its node (a
        # process's own death keeps it in the page cache) costs status an approximate end of
        # that task, never work. The task records (tasks.jsonl) are synced at every line.
        now = time.monotonic()
        sync = now - self._synced >= METRICS_SYNC_SECONDS
        self._append("metrics.jsonl", {**record, "time": round(time.time(), 3), **self.stamp}, sync=sync)
        self._unsynced = self.enabled and not sync
        if sync:
            self._synced = now
        if self.enabled and time.monotonic() - self._summarized >= SUMMARY_EVERY_SECONDS:
            self.refresh_summary()

    def refresh_summary(self) -> None:
        """Bring the summary of metrics.jsonl up to date, in a thread of its own: a summary
        nobody kept yet means one read of the whole file, which must not hold up a step (not a
        daemon: an exit waits for it rather than leave its temporary file). A summary is a
        cache: one that cannot be written or read costs a reader time, never the run (its
        failure is one line on stderr)."""
        self._summarized = time.monotonic()
        if self._summarizing is not None and self._summarizing.is_alive():
            return
        self._summarizing = threading.Thread(target=_refresh, args=(self.run_dir,), name="metrics-summary")
        self._summarizing.start()

    def log_task(self, record: dict[str, Any]) -> None:
        if self._unsynced:  # the steps' last lines reach the disk before the task's record of them
            with (self.run_dir / "metrics.jsonl").open("a") as fh:
                os.fsync(fh.fileno())
            self._unsynced = False
        self._append(
            "tasks.jsonl",
            {"time": round(time.time(), 3), **self.stamp, **self.array, **record},
        )

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            write_json_atomic(self.run_dir / "metrics.json", {**self.stamp, **summary})


def _refresh(run_dir: Path) -> None:
    try:
        summarize(RunDir(run_dir).metrics)
    except Exception as exc:  # noqa: BLE001 - a cache's failure must not end a week-long run
        print(f"jobgen: warning: could not bring the summary of metrics.jsonl up to date: {exc!r}", file=sys.stderr)
