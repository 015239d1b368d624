"""The append-only JSON-lines records of a run: ``metrics.jsonl`` (a line per logging step and
per evaluation) and ``tasks.jsonl`` (each task's first step and exit), as every reader takes
them: each line checked once as it is read (:func:`record_problem` against the fields the
readers compute with), a line that is no record skipped and counted (:class:`Records`), a last
line cut by a crash skipped without counting.

The trainer and a user's program write them through :mod:`jobgen.runtime.records`; a long run's
``metrics.jsonl`` is read through its summary (:mod:`jobgen.runs.metrics_summary`), which reads
each line as :func:`read_records` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobgen.base.safe_read import (
    LINES_FILE,
    DamagedFile,
    is_int,
    is_number,
    is_time,
    lines_backwards,
    open_regular,
    read_bytes,
)

# ``metrics.jsonl`` holds training steps and, with ``[eval]``, evaluations: an evaluation's
# line has ``event = "eval"`` (and eval_loss, eval_ppl, eval_tokens, eval_seconds), a step's none.
EVAL_EVENT = "eval"


def is_eval_line(line: dict[str, Any]) -> bool:
    return line.get("event") == EVAL_EVENT


def training_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training steps' lines of ``metrics.jsonl``, evaluations left out."""
    return [line for line in lines if not is_eval_line(line)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line; a line cut by a crash mid-write is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


# --------------------------------------------------------------------------- typed records
#
# metrics.jsonl and tasks.jsonl are appended by the trainer or a user's program (through
# jobgen.runtime) and may be edited by hand; every reader computes with their fields (int(),
# float(), a date from a time). A line that is JSON but not a record would raise in each of
# them, so lines are checked once, here, as they are read. A hand-written check rather than a
# pydantic model per line: the files reach 100k lines and status reads them on every call.
# Only the fields the readers use are checked; the others (a program's own metrics) pass.


def _job_id(value: Any) -> bool:
    return isinstance(value, str) or is_int(value)


def _numbers(value: Any) -> bool:
    return isinstance(value, list) and all(is_number(v) for v in value)


_Check = tuple[Callable[[Any], bool], str]
# Bounded: a step of 10**400 overflows every float computed from it.
_INT: _Check = (is_int, "an integer")
# NaN and infinity stay allowed in values: a diverged loss is logged as it was.
_NUMBER: _Check = (is_number, "a number")
# Times become dates and plot axes; 1e400 parses as infinity, 1e300 is no date: both overflow.
_FINITE: _Check = (is_time, "a time (seconds since 1970)")
_JOB_ID: _Check = (_job_id, "a job id (string or integer)")

# (required fields, optional fields: None is allowed for those)
METRICS_FIELDS: tuple[dict[str, _Check], dict[str, _Check]] = (
    {"time": _FINITE, "step": _INT},
    {
        "job_id": _JOB_ID,
        "restart": _INT,
        "launch": _INT,
        "event": (lambda v: isinstance(v, str), "a string"),
        **dict.fromkeys(("loss", "lr", "tokens_per_s", "step_seconds", "eval_loss", "eval_ppl"), _NUMBER),
        "host_used_percent": _NUMBER,
    },
)
TASKS_FIELDS: tuple[dict[str, _Check], dict[str, _Check]] = (
    {"time": _FINITE},
    {
        "job_id": _JOB_ID,
        "restart": _INT,
        "launch": _INT,
        "event": (lambda v: isinstance(v, str), "a string"),
        "array_job_id": _JOB_ID,
        "array_task": _JOB_ID,
        "step": _INT,
        "start_step": _INT,
        "end_step": _INT,
        "exit_code": _INT,
        "job_start": _FINITE,
        "exit_reason": (lambda v: isinstance(v, str), "a string"),
        **dict.fromkeys(("world_size", "global_batch"), _INT),
        **dict.fromkeys(
            ("seconds_to_first_step", "step_seconds_total", "step_seconds_max", "eval_round_seconds_max"), _NUMBER
        ),
        "save_seconds": (_numbers, "a list of numbers"),
    },
)


def record_problem(record: Any, fields: tuple[dict[str, _Check], dict[str, _Check]]) -> str | None:
    """What makes one decoded line no record of its file, or None when it is one."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    required, optional = fields
    for key, (ok, what) in required.items():
        if key not in record:
            return f"no {key!r}"
        if not ok(record[key]):
            return f"{key!r} is {record[key]!r}, not {what}"
    # The record's own keys, looked up among the checked ones: a line holds a dozen keys, and
    # this runs for every line of a file a week long.
    for key, value in record.items():
        check = optional.get(key)
        if check is not None and value is not None and not check[0](value):
            return f"{key!r} is {value!r}, not {check[1]}"
    return None


class Records(list):
    """The records of one JSONL file, with how many lines were skipped as not records and
    why the first of them was."""

    def __init__(self, path: Path, kind: str):
        super().__init__()
        self.path = path
        self.kind = kind
        self.skipped = 0
        self.first_problem = ""
        self.unreadable: str | None = None  # why the file as a whole could not be read

    def skip(self, number: int | str, problem: str) -> None:
        if not self.skipped:
            self.first_problem = f"line {number}: {problem}"
        self.skipped += 1

    def warning(self) -> str | None:
        """One line for the tools to show, naming the file and what was wrong; None when
        every line was a record."""
        if self.unreadable is not None:
            return f"{self.path}: {self.unreadable}: no {self.kind} records read from it"
        if not self.skipped:
            return None
        return (
            f"{self.path}: skipped {self.skipped} line(s) that are not {self.kind} records "
            f"(first at {self.first_problem})"
        )


def read_records(path: Path, fields: tuple[dict[str, _Check], dict[str, _Check]], kind: str) -> Records:
    """The lines of ``path`` that are records (checked against ``fields``); the others are
    skipped and counted. A last line that is no JSON is a write cut by a crash, not a bad
    record: skipped without counting, as :func:`read_jsonl` does. A file that cannot be read
    at all (a link, a directory, too large: jobgen.base.safe_read.read_bytes) has no records, and
    ``warning()`` says why."""
    out = Records(path, kind)
    try:
        text = read_bytes(path, LINES_FILE).decode(errors="replace")
    except FileNotFoundError:
        return out
    except DamagedFile as exc:
        out.unreadable = exc.problem
        return out
    # Lines end at "\n" only: a record may hold U+2028 or U+0085, which splitlines() breaks at.
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError; an int of 5000 digits
            if number < len(lines) and line.strip():
                out.skip(number, f"not JSON ({getattr(exc, 'msg', 'nested too deep')})")
            continue
        problem = record_problem(record, fields)
        if problem is None:
            out.append(record)
        else:
            out.skip(number, problem)
    return out


def read_newest_records(
    path: Path,
    fields: tuple[dict[str, _Check], dict[str, _Check]],
    kind: str,
    enough: Callable[[list[dict[str, Any]]], bool],
) -> tuple[Records, bool]:
    """The newest records of ``path``, read from its end a block at a time until ``enough``
    (given the records read so far, newest first) says so: (those records in the file's
    order, whether older lines were left unread). Lines are checked and skipped as
    :func:`read_records` does; a skipped line is named by its number when the read reached
    the file's start, else by its place from the end."""
    out = Records(path, kind)
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return out, False
    except DamagedFile as exc:
        out.unreadable = exc.problem
        return out, False
    newest_first: list[dict[str, Any]] = []
    skipped: list[tuple[int, str]] = []  # (place from the end, 1 = the last line; problem), newest first
    with os.fdopen(fd, "rb") as fh:
        blocks = lines_backwards(fh, os.fstat(fd).st_size)
        from_end, last_line, left = 0, True, True
        while left and not enough(newest_first):
            pieces, at_start = next(blocks, ([], True))
            left = not at_start
            if last_line and pieces and pieces[-1] == b"":
                pieces.pop()  # the file ends with a newline: nothing after it
            for piece in reversed(pieces):
                from_end += 1
                _read_line(piece, last_line, newest_first, skipped, from_end, fields)
                last_line = False
    for place, problem in reversed(skipped):  # the first in the file's order is the one named
        out.skip(f"{place} from the end" if left else from_end - place + 1, problem)
    out.extend(reversed(newest_first))
    return out, left


def _read_line(
    piece: bytes,
    last_line: bool,
    into: list[dict[str, Any]],
    skipped: list[tuple[int, str]],
    place: int,
    fields: tuple[dict[str, _Check], dict[str, _Check]],
) -> None:
    line = piece.decode(errors="replace")
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:
        if not last_line and line.strip():  # a last line that is no JSON: a write cut short
            skipped.append((place, f"not JSON ({getattr(exc, 'msg', 'nested too deep')})"))
        return
    problem = record_problem(record, fields)
    if problem is None:
        into.append(record)
    else:
        skipped.append((place, problem))


def read_metrics(path: Path) -> Records:
    """``metrics.jsonl``: training steps and evaluations (``event = "eval"``), each with a
    time and a step."""
    return read_records(path, METRICS_FIELDS, "metrics")


def read_tasks(path: Path) -> Records:
    """``tasks.jsonl``: the trainer's first-step and exit records."""
    return read_records(path, TASKS_FIELDS, "task")


# (job id, Slurm's restart count, the launch inside the task): one run of the program. A
# requeued job keeps its id and Slurm counts its restarts; the batch script counts the
# program's relaunches inside one allocation (job.in_job_restarts; records before it have none).
TaskKey = tuple[str, int, int]


def task_key(record: dict[str, Any]) -> TaskKey:
    return str(record.get("job_id")), int(record.get("restart") or 0), int(record.get("launch") or 0)
