"""What the supervisor writes into the run directory, each write to a temporary name, fsynced and
renamed: the task record (``jobgen status`` shows every task after Slurm has forgotten it), the
run's done and failed markers (no task starts again), and the crash history of your own program
(a crash that repeats stops the run). Files read back are input: read without following a link,
bounded, and a damaged one counts as absent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobgen.base.atomic import write_json_atomic, write_text_atomic
from jobgen.base.safe_read import DamagedFile, open_regular, read_bytes, read_optional_json
from jobgen.job.decisions import CrashHistory, CrashSignature, ExitRecord, parse_exit_record
from jobgen.job.settings import Task
from jobgen.runs.rundir import RunDir


def write_task_record(
    run: RunDir, task: Task, end: float | None, code: int | None, slurm_exit: int | None, reason: str,
    restarts: list[dict[str, Any]] | None,
) -> None:  # fmt: skip
    """The task's record; ``None`` codes: started, not ended yet. The same fields as the batch
    script's own writer, which records the task's start and the ends before the supervisor runs."""
    record: dict[str, Any] = {
        "job_id": task.job_id,
        "array_job_id": task.array_job_id or "",
        "array_task": task.array_task or "",
        "restart": task.restart,
        "nodes": task.nodelist,
        "job_start": task.job_start,
        "end": None if code is None else int(end or time.time()),
        "exit_code": code,
        "slurm_exit": slurm_exit,
        "reason": reason,
    }
    if restarts is not None:
        record["restarts"] = restarts
    write_json_atomic(run.task_record(task.job_id or "none", task.restart), record)


def mark_done(run: RunDir, words: str) -> None:
    write_text_atomic(run.done_marker, words + "\n")


def read_exit_record(run: RunDir, task: Task) -> ExitRecord | None:
    """This attempt's exit record; None when there is none, or none that can be read."""
    try:
        data = read_bytes(run.exit_code_file(task.job_id, task.restart), limit=64 * 1024)
    except (OSError, DamagedFile):  # FileNotFoundError included: the program left none
        return None
    return parse_exit_record(data.decode(errors="replace"))


def clear_exit_record(run: RunDir, task: Task) -> None:
    """Before a relaunch: the record of the launch before it was read already."""
    run.exit_code_file(task.job_id, task.restart).unlink(missing_ok=True)


def crash_file(run: RunDir) -> Path:
    """The last crash of your own program (a program of jobgen's keeps logs/attempt.json)."""
    return run.logs / "command-crash.json"


def read_crash(run: RunDir) -> CrashHistory | None:
    try:
        value = read_optional_json(crash_file(run))
    except (OSError, DamagedFile):
        return None
    if not isinstance(value, dict):
        return None
    try:
        signature = CrashSignature(int(value["status"]), str(value["line"]))
        array = value.get("array_job_id")
        return CrashHistory(
            signature, str(value["job_id"]), str(array) if array else None, int(value["restart"]), int(value["launch"])
        )
    except (KeyError, TypeError, ValueError):
        return None


def write_crash(run: RunDir, task: Task, launch: int, signature: CrashSignature) -> None:
    record = {"status": signature.status, "line": signature.line, "job_id": task.job_id, "launch": launch}
    write_json_atomic(crash_file(run), {**record, "array_job_id": task.array_job_id, "restart": task.restart})


def error_tail(run: RunDir, task: Task, nodes: list[str], since: float) -> list[str]:
    """The ends of this launch's rank stderr files (torchrun --log-dir: one directory per launch
    under each node's rank logs), lowest rank directory first: where your own program said why."""
    for path in _launch_rank_logs(run, task, nodes, since, "stderr.log"):
        try:
            data = _tail(path)
        except (OSError, DamagedFile):
            continue
        lines = data.decode(errors="replace").splitlines()
        if any(line.strip() for line in lines):
            return lines
    return []


def ranks_started(run: RunDir, task: Task, nodes: list[str], since: float) -> bool:
    """Whether a rank of this launch started: torchrun wrote one of its rank logs since ``since``."""
    return next(_launch_rank_logs(run, task, nodes, since, "std*.log"), None) is not None


def _launch_rank_logs(run: RunDir, task: Task, nodes: list[str], since: float, name: str) -> Iterator[Path]:
    """The rank log files ``name`` (a glob) of the launch begun at ``since`` (torchrun --log-dir:
    one directory per launch under each node's rank logs), node by node, lowest rank directory first."""
    for node in nodes:
        for path in sorted(run.rank_logs(task.job_id, node).glob(f"*/attempt_*/*/{name}")):
            try:
                if path.stat().st_mtime >= since:
                    yield path
            except OSError:  # it went while the directory was read
                continue


def _tail(path: Path, size: int = 8192) -> bytes:
    fd = open_regular(path)  # no link followed, no FIFO waited on
    try:
        os.lseek(fd, max(0, os.fstat(fd).st_size - size), os.SEEK_SET)
        return os.read(fd, size)
    finally:
        os.close(fd)


def write_stop_request(path: Path, signal_name: str) -> None:
    """The signal's name and when it came: the program tells a time limit from a preemption and
    says how early it came. switches/ is the team's: a new file (O_EXCL) renamed over the name
    replaces whatever is there instead of writing through it."""
    write_text_atomic(path, f"{signal_name} {int(time.time())}\n", mode=0o644)
