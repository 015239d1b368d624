"""The files of a run directory as jobgen reads them: one typed reader per kind of file, each
checking what it reads and raising :class:`DamagedFile` (which names the file and what is
wrong with it) for anything that is not what jobgen or its trainer writes there.

A run directory is shared: teammates, a user's own program and hand edits all write into
it, and a crash may cut a write short. So a file is input like any other, and every command
reads it through the reader of its kind, here or beside the file's owner (``spec.json`` in
:mod:`jobgen.spec.spec_json`, the JSONL records in :mod:`jobgen.runs.goodput`, ``quarantine.json`` in
:mod:`jobgen.runs.quarantine`, a command plan in :mod:`jobgen.launch.command_plan`), never with a bare
``json.loads``. This module imports no spec model: the spec models' own modules read through
it (a Trainer's checkpoint, jobgen.program.trainer_records).

- a file is read only if it is a regular file of at most :data:`SMALL_FILE` bytes
  (:data:`LINES_FILE` for the append-only JSONL records). jobgen writes no symbolic links
  into a run directory, so a link where one of its files should be is refused, not
  followed: it could lead to another run's file, or to a FIFO or a device that never ends
  or never answers. A FIFO, a device or a directory at the name is refused the same way,
  without opening it (and the open never waits: ``O_NONBLOCK``, ``O_NOFOLLOW``);
- its content must be JSON of the shape its kind has; a value of the wrong type, a number
  no reader can compute with (1e400 parses as infinity) or a structure too deep to parse is
  the file's damage, named with its key.

What a command does with a :class:`DamagedFile` is the command's to decide (docs/operating-runs.md,
"What jobgen trusts on disk"): a listing shows the rest and names the file, a command that
needs the file refuses in one line before it acts, and the ``jobgen`` command group turns one
that reaches it into that line (exit status 1), never a traceback.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from jobgen.base.visible import visible

# The most jobgen reads of one JSON file (a spec, a record, a trainer's history) ...
SMALL_FILE = 64 << 20
# ... and of an append-only JSONL file (metrics.jsonl of a long run reaches a few hundred MiB).
LINES_FILE = 4 << 30
# The latest time a record may carry (the year 3000): a date beyond it is no record of a run,
# and ``time.localtime`` or a plot's date axis fails on one far enough out.
LATEST_TIME = 32503680000
# Job ids and step numbers beyond this are no Slurm job and no step: they would only
# overflow what is computed from them (a date, a range of array tasks).
LARGEST_ID = 2**63 - 1


class DamagedFile(ValueError):
    """A file of a run, a sweep or a server that is not what jobgen writes there: missing
    parts, the wrong JSON, cut short, a link or something that is no file. ``str()`` is one
    line, ``<path>: <problem>``, with control characters made visible (jobgen.base.visible). A
    ValueError, so that callers which took a bad file as ``(OSError, ValueError)`` still do."""

    def __init__(self, path: Path | str, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{visible(path)}: {visible(problem)}")


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def _refuse_unless_regular(path: Path, mode: int) -> None:
    if stat.S_ISLNK(mode):
        try:
            where = f" (to {os.readlink(path)})"
        except OSError:
            where = ""
        raise DamagedFile(path, f"is a symbolic link{where}: jobgen writes no links there and follows none")
    if not stat.S_ISREG(mode):
        raise DamagedFile(path, f"is {_kind(mode)}, not a file")


def open_regular(path: Path) -> int:
    """A file descriptor (read-only) of the regular file at ``path``, never a link, a FIFO or
    a device: FileNotFoundError when nothing is there, :class:`DamagedFile` otherwise. For the
    readers of files that grow (logs), which read from an offset; the caller closes it."""
    try:
        _refuse_unless_regular(path, os.lstat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DamagedFile(path, f"cannot read it: {exc.strerror or exc}") from None
    try:
        _refuse_unless_regular(path, os.fstat(fd).st_mode)  # replaced between the look and the open
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: Path, limit: int = SMALL_FILE) -> bytes:
    """The content of the regular file at ``path``, at most ``limit`` bytes. Raises
    FileNotFoundError when nothing is there (each caller knows what a missing file means),
    :class:`DamagedFile` for anything else that is not a readable regular file."""
    fd = open_regular(path)
    try:
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise DamagedFile(path, f"cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise DamagedFile(path, f"is larger than {limit >> 20} MiB, more than any such file jobgen writes")
    return b"".join(chunks)


# What a reader from a file's end reads at a time.
BACKWARD_BLOCK = 1 << 16


def lines_backwards(fh: BinaryIO, size: int, block: int = BACKWARD_BLOCK) -> Iterator[tuple[list[bytes], bool]]:
    """The first ``size`` bytes of ``fh`` as lines, read from the end a block at a time (the
    newest lines of a long log or JSONL file without reading its history): for each block,
    its lines in the file's order, without their newlines, and whether the file's start was
    reached. The first list's last item is what follows the last newline (b"" when the file
    ends with one; else a line still being written or cut short). A line longer than a block
    comes whole, with the block that holds its start."""
    start, head = size, b""
    while start > 0:
        begin = max(0, start - block)
        fh.seek(begin)
        pieces = (fh.read(start - begin) + head).split(b"\n")
        start = begin
        head = pieces.pop(0) if start > 0 else b""  # may begin mid-line: the next block completes it
        if pieces:
            yield pieces, start == 0


def parse_json(path: Path, data: bytes | str) -> Any:
    """``data`` (the content of ``path``) as JSON; :class:`DamagedFile` when it is none."""
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        raise DamagedFile(path, "invalid JSON: not UTF-8 text") from None
    except ValueError as exc:  # JSONDecodeError (cut short by a crash, or edited); an int of 5000 digits
        raise DamagedFile(path, f"invalid JSON: {exc}") from None
    except RecursionError:
        raise DamagedFile(path, "invalid JSON: nested too deep to read") from None


def read_json(path: Path, limit: int = SMALL_FILE) -> Any:
    """The JSON in the file at ``path`` (FileNotFoundError when there is none)."""
    return parse_json(path, read_bytes(path, limit))


def read_optional_json(path: Path) -> Any | None:
    """The JSON in the file at ``path``, or None when there is nothing there."""
    try:
        return read_json(path)
    except FileNotFoundError:
        return None


def is_int(value: Any) -> bool:
    """An integer a reader can compute with: not a bool, not beyond :data:`LARGEST_ID`."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= LARGEST_ID


def is_number(value: Any) -> bool:
    """A number a reader can compute with as a float: not a bool, no integer beyond
    :data:`LARGEST_ID` (10**400 overflows every float made of it). NaN and infinity pass: a
    diverged loss is logged as it was."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) <= LARGEST_ID)


def is_finite(value: Any) -> bool:
    """A number that is not NaN or infinite (1e400 parses as infinity)."""
    return is_number(value) and math.isfinite(value)


def is_time(value: Any) -> bool:
    """A time in seconds since 1970 that a date can be made of."""
    return is_finite(value) and 0 <= value <= LATEST_TIME


def as_int(value: Any) -> int | None:
    """A job id, an array task or a restart count as an int, from an int or a string of
    ASCII digits ("17", not "²", which ``str.isdigit`` takes and ``int`` refuses); None for
    anything else."""
    if is_int(value):
        return value
    text = value if isinstance(value, str) else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


# --------------------------------------------------------------------------- jobs.json

# No submission of jobgen's has more array tasks (jobgen.spec.tables.run.MAX_ARRAY, submit --array):
# more would only make a reader count through millions of tasks that never existed.
MOST_ARRAY_TASKS = 1000
# Keys of a submission in jobs.json and what each must be when present (None allowed).
_JOB_KEYS = {
    "array": (lambda v: is_int(v) and 0 <= v <= MOST_ARRAY_TASKS, "a number of array tasks (at most 1000)"),
    "local": (lambda v: isinstance(v, bool), "true or false"),
    "after": (is_int, "a job id"),
    "submitted_at": (lambda v: isinstance(v, str), "a time"),
    "options": (lambda v: isinstance(v, list), "a list of options"),
}


def read_jobs(path: Path) -> list[dict[str, Any]]:
    """``jobs.json``: every submission of the run (job id, array, local, when); [] before the
    first. Each entry is checked for what the readers compute with."""
    jobs = read_optional_json(path)
    if jobs is None:
        return []
    if not isinstance(jobs, list):
        raise DamagedFile(path, "not a list of submissions (objects with an integer 'job_id')")
    for number, job in enumerate(jobs):
        if not isinstance(job, dict) or not (is_int(job.get("job_id")) and job["job_id"] >= 0):
            raise DamagedFile(path, f"[{number}]: not a submission (an object with an integer 'job_id')")
        for key, (ok, what) in _JOB_KEYS.items():
            if job.get(key) is not None and not ok(job[key]):
                raise DamagedFile(path, f"[{number}].{key}: {visible(repr(job[key]))[:80]} is not {what}")
    return jobs


# --------------------------------------------------------------------------- best.json


def read_best(path: Path) -> dict[str, Any] | None:
    """``checkpoints/best.json``: the checkpoint with the lowest eval loss (step, checkpoint,
    eval_loss, time), or None when there is none yet."""
    best = read_optional_json(path)
    if best is None:
        return None
    if not isinstance(best, dict):
        raise DamagedFile(path, "not a best-checkpoint record (an object with step, checkpoint and eval_loss)")
    checks = {
        "step": (lambda v: is_int(v) and v >= 0, "a step"),
        "checkpoint": (lambda v: isinstance(v, str), "a checkpoint's name"),
        "eval_loss": (is_number, "a number"),
    }
    for key, (ok, what) in checks.items():
        if not ok(best.get(key)):
            raise DamagedFile(path, f"{key}: {visible(repr(best.get(key)))[:80]} is not {what}")
    if best.get("time") is not None and not is_finite(best["time"]):
        raise DamagedFile(path, "time: not a time")
    return best


# --------------------------------------------------------------------------- small records


def read_object(path: Path, what: str) -> dict[str, Any] | None:
    """A small JSON object (doctor.json, a task's end record, a rank map), or None when
    there is none; :class:`DamagedFile` saying it is no ``what`` when it is no object."""
    value = read_optional_json(path)
    if value is not None and not isinstance(value, dict):
        raise DamagedFile(path, f"not {what} (a JSON object)")
    return value


def read_failure(path: Path) -> dict[str, Any] | None:
    """The ``failed`` marker (exit_code, reason, fix, job_id, ...), or None without one. It is
    there as the batch script tests it (``-e``: a link to a file counts); a marker that cannot
    be read still stops the run, and says so."""
    if not path.exists():
        return None
    try:
        return read_object(path, "a failure record") or {}
    except (DamagedFile, FileNotFoundError) as exc:
        why = exc.problem if isinstance(exc, DamagedFile) else "removed while read"
        return {"reason": f"{path} is unreadable ({why})", "fix": "read it, then `jobgen submit` the run again"}
