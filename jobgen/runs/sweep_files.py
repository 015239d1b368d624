"""A sweep's own files: their names, and the one reader of each (``sweep.json``, the claims).

Layout of a sweep's directory, ``<runs_root>/<job.name>/``::

    sweep.json     the index: the sweep's name, max_parallel, its points (name, overrides,
                   program, tasks per array) and the arrays submitted (SweepIndex)
    sweep.sbatch   the one batch script of the array (jobgen.sweep.render)
    claims.jsonl   every claim an array task made, one JSON object a line (Claim)
    claims/        <point>.json: the claim that holds each point now
    logs/          the array's own output, one file per task
    .claims.lock   flock'ed while a task claims (jobgen.sweep.claim)
    points/        <point>/: each point's run directory (jobgen.runs.rundir.RunDir)

Point directories live under ``points/``, so no point name, whatever it is, can be one of the
sweep's own files. A point's directory is always ``<sweep>/points/<name>``: derived from the
directory the command was given and the point's name (a plain name, checked here), never
read from a path recorded in a file, so a sweep that was moved or copied is acted on where
it is. Sweeps submitted before (format 1) kept their points beside sweep.json: they are
read as they are (their point names checked against the sweep's file names), and continue.

Everything read here is input: a file that is not what jobgen writes is a SweepFileError
naming it (``sweep.json``), or a claim line skipped and counted (``claims.jsonl``: an array
task never stops claiming for a torn or hand-edited line). Standard library only: the claim
runs in the job's own Python, ``python -I -S`` (tests/unit/test_sweep_claim.py).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobgen.base.safe_read import LINES_FILE, DamagedFile, parse_json, read_bytes
from jobgen.program.kinds import PROGRAMS as KINDS
from jobgen.runs.rundir import RunDir, RunDirError

SWEEP_INDEX = "sweep.json"
SWEEP_SCRIPT = "sweep.sbatch"
CLAIMS_LOG = "claims.jsonl"
CLAIMS_DIR = "claims"
LOGS_DIR = "logs"
LOCK_FILE = ".claims.lock"
POINTS_DIR = "points"
SWEEP_FILES = (SWEEP_INDEX, SWEEP_SCRIPT, CLAIMS_LOG, CLAIMS_DIR, LOGS_DIR, LOCK_FILE, POINTS_DIR)

FLAT = 1  # points beside sweep.json (jobgen before points/): read and continued, no new points
FORMAT = 2  # points under points/

# A point's name is its job.name (jobgen.spec.fields.JobName): no '/', never '.' or '..'.
POINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# job.program, the names of jobgen.program.kinds' table: the point's script is <program>.sbatch
# in its directory (jobgen.runs.rundir.RunDir.script).
PROGRAMS = tuple(KINDS)
_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII only: '²'.isdigit() is True, int('²') fails
# An override's key: a dotted key into run.toml, as [sweep] spells them (jobgen.spec.tables.sweep's
# pattern: tests/unit/test_sweep_files.py keeps the two equal).
DOTTED_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class SweepFileError(DamagedFile, RunDirError):
    """A sweep's file that is not what jobgen writes (or a point directory that is not the
    sweep's own): one sentence naming the file, for every command that reads it. A
    DamagedFile (the jobgen group's one line when a command leaves it unhandled) and a
    RunDirError (what the commands that find runs already handle)."""


@dataclass(frozen=True)
class PointEntry:
    """A point as sweep.json records it: what it is, not where (that is derived)."""

    name: str
    overrides: dict[str, Any]
    program: str | None  # None: written into the file, never submitted
    attempts: int  # job.array: tasks per array


@dataclass(frozen=True)
class SweepJob:
    job_id: int
    options: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SweepIndex:
    """sweep.json, validated, read from ``directory`` (where it is now)."""

    directory: Path
    format: int
    name: str
    max_parallel: int
    points: list[PointEntry]
    jobs: list[SweepJob]

    def point_dir(self, name: str) -> Path:
        return point_dir(self.directory, name, self.format)

    def run(self, entry: PointEntry) -> RunDir:
        return RunDir(self.point_dir(entry.name))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "name": self.name,
            "max_parallel": self.max_parallel,
            "points": [self._entry_json(p) for p in self.points],
            "jobs": [{"job_id": j.job_id, "options": list(j.options)} for j in self.jobs],
        }

    def _entry_json(self, entry: PointEntry) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": entry.name,
            "overrides": entry.overrides,
            "program": entry.program,
            "attempts": entry.attempts,
        }
        if self.format == FLAT and entry.program is not None:
            # A format-1 sweep's array may have been queued by an older jobgen, whose claim
            # reads these paths; this jobgen never does.
            run = self.run(entry)
            out |= {
                "dir": str(run.path),
                "script": str(run.script(entry.program)),
                "log": str(run.batch_log(entry.name, "{job_id}")),
                "done": str(run.done_marker),
                "failed": str(run.failed_marker),
                "kill": str(run.switch("kill")),
            }
        return out


def is_point_name(name: object) -> bool:
    return isinstance(name, str) and POINT_NAME.fullmatch(name) is not None


def point_dir(directory: Path, name: str, fmt: int = FORMAT) -> Path:
    """``<sweep>/points/<name>`` (format 1: ``<sweep>/<name>``); raises SweepFileError for a
    name that is not a plain point name, or a directory on the way that is a symbolic link
    (it would lead out of the sweep)."""
    index = directory / SWEEP_INDEX
    if not is_point_name(name) or (fmt == FLAT and name in SWEEP_FILES):
        raise SweepFileError(index, f"{name!r:.80} is not a point's name (letters, digits and ._- only)")
    base = directory / POINTS_DIR if fmt != FLAT else directory
    for path in (base, base / name):
        if path.is_symlink():
            raise SweepFileError(path, "is a symbolic link: a sweep's points are directories of its own")
    return base / name


# ---------------------------------------------------------------- sweep.json


def read_index(directory: Path) -> SweepIndex:
    """``directory/sweep.json``, validated (raises SweepFileError naming the file and key)."""
    path = directory / SWEEP_INDEX
    try:  # a regular file only, bounded, never a link, a FIFO or a device (jobgen.base.safe_read)
        data = parse_json(path, read_bytes(path))
    except FileNotFoundError:
        raise SweepFileError(path, "is gone") from None
    except DamagedFile as exc:
        raise SweepFileError(path, exc.problem) from None
    return parse_index(directory, data)


def _fail(directory: Path, key: str, problem: str) -> SweepFileError:
    return SweepFileError(directory / SWEEP_INDEX, f"{key}: {problem}" if key else problem)


def _int(value: Any, lowest: int) -> int | None:
    """A JSON integer >= lowest (not a bool), else None."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lowest
    return value if ok else None


def parse_index(directory: Path, data: Any) -> SweepIndex:
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise _fail(directory, "", "not a sweep's index (an object with a list 'points')")
    fmt = _int(data.get("format", FLAT), FLAT)
    if fmt not in (FLAT, FORMAT):
        raise _fail(directory, "format", "not a format this jobgen reads (1 or 2)")
    if "format" not in data and (directory / POINTS_DIR).is_dir():
        # Format 1 had no points/: the key is missing from a file that this jobgen wrote.
        raise _fail(directory, "format", f"missing, while the sweep's points are under {POINTS_DIR}/")
    name = data.get("name", directory.name)
    if not is_point_name(name):
        raise _fail(directory, "name", "not a job name")
    max_parallel = _int(data.get("max_parallel", 1), 1)
    if max_parallel is None:
        raise _fail(directory, "max_parallel", "not an integer of at least 1")
    points = [_entry(directory, f"points[{i}]", p, fmt) for i, p in enumerate(data["points"])]
    twice = sorted(name for name, count in Counter(p.name for p in points).items() if count > 1)
    if twice:
        raise _fail(directory, "points", f"two points are named {twice[0]!r}")
    jobs = data.get("jobs", [])
    if not isinstance(jobs, list):
        raise _fail(directory, "jobs", "not a list")
    index = SweepIndex(directory, fmt, name, max_parallel, points, [_job(directory, i, j) for i, j in enumerate(jobs)])
    for entry in points:
        index.point_dir(entry.name)  # a name or a link that would lead out of the sweep
    return index


def _entry(directory: Path, key: str, raw: Any, fmt: int) -> PointEntry:
    if not isinstance(raw, dict):
        raise _fail(directory, key, "not an object")
    if not is_point_name(raw.get("name")):
        raise _fail(directory, f"{key}.name", "not a point's name (letters, digits and ._- only)")
    overrides = raw.get("overrides", {})
    if not isinstance(overrides, dict) or not all(DOTTED_KEY.fullmatch(k) for k in overrides):
        raise _fail(directory, f"{key}.overrides", "not an object of dotted keys (train.lr, ...)")
    attempts = _int(raw.get("attempts"), 1)
    if attempts is None:
        raise _fail(directory, f"{key}.attempts", "not an integer of at least 1")
    program = raw.get("program")
    if fmt == FLAT and program is None and isinstance(raw.get("script"), str):
        program = Path(raw["script"]).name.removesuffix(".sbatch")  # format 1 named the script
    if program is not None and program not in PROGRAMS:
        raise _fail(directory, f"{key}.program", f"not one of {', '.join(PROGRAMS)}")
    return PointEntry(raw["name"], overrides, program, attempts)


def _job(directory: Path, index: int, raw: Any) -> SweepJob:
    text = _job_id(raw.get("job_id")) if isinstance(raw, dict) else None
    job_id = int(text) if text is not None else 0
    if job_id < 1:
        raise _fail(directory, f"jobs[{index}].job_id", "not a job id (an integer)")
    options = raw.get("options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise _fail(directory, f"jobs[{index}].options", "not a list of strings")
    return SweepJob(job_id, options)


# ---------------------------------------------------------------- claims


@dataclass(frozen=True)
class Claim:
    """One array task's claim of a point."""

    point: str
    job_id: str  # ASCII digits: the task's own job id
    array_job_id: str
    task: str
    restart: int = 0
    time: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "point": self.point,
            "job_id": self.job_id,
            "array_job_id": self.array_job_id,
            "task": self.task,
            "restart": self.restart,
            "time": self.time,
        }


def _job_id(value: Any) -> str | None:
    """A job id as text of ASCII digits (claims write them as text, sweep.json as numbers)."""
    if _int(value, 0) is not None:
        value = str(value)
    return value if isinstance(value, str) and _DIGITS.fullmatch(value) else None


def parse_claim(raw: Any) -> Claim | None:
    """A claim as jobgen writes it, or None for anything else."""
    if not isinstance(raw, dict) or not is_point_name(raw.get("point")):
        return None
    job_id = _job_id(raw.get("job_id"))
    array_job_id = _job_id(raw.get("array_job_id", job_id))
    if job_id is None or array_job_id is None:
        return None
    when = raw.get("time")
    return Claim(
        point=raw["point"],
        job_id=job_id,
        array_job_id=array_job_id,
        task=str(raw.get("task", "")),
        restart=_int(raw.get("restart", 0), 0) or 0,
        time=float(when) if isinstance(when, int | float) and not isinstance(when, bool) else None,
    )


@dataclass
class Claims:
    """What claims.jsonl and claims/ say, and how many of their entries could not be read."""

    directory: Path
    log: list[Claim]  # every claim, oldest first
    skipped: list[str] = field(default_factory=list)  # "<file>: <n> line(s)" of what was skipped

    def current(self, point: str) -> Claim | None:
        """The claim that holds ``point`` now (claims/<point>.json), or None. One that cannot
        be read is counted, and the point's last claim in claims.jsonl stands in for it: a
        damaged file never frees a point a live task may still be running."""
        path = self.directory / CLAIMS_DIR / f"{point}.json"
        try:
            raw = parse_json(path, read_bytes(path))
        except FileNotFoundError:
            return None
        except DamagedFile:  # a link, a FIFO, cut short: counted below, never followed or waited on
            raw = None
        found = parse_claim(raw)
        if found is None or found.point != point:
            self.skipped.append(f"{path}: unreadable")
            return next((c for c in reversed(self.log) if c.point == point), None)
        return found

    def of(self, point: str) -> list[Claim]:
        return [c for c in self.log if c.point == point]


def read_claims(directory: Path) -> Claims:
    """claims.jsonl, oldest first: a line that is not a claim (torn, hand-edited, not an
    object, no point) is skipped and counted, never the end of the reading."""
    path = directory / CLAIMS_LOG
    try:
        lines = read_bytes(path, LINES_FILE).splitlines()
    except FileNotFoundError:
        lines = []
    except DamagedFile as exc:  # not a file jobgen could append to either: say so, claim nothing
        raise SweepFileError(path, exc.problem) from None
    out, bad = [], 0
    for line in lines:
        try:
            found = parse_claim(json.loads(line))
        except ValueError:
            found = None
        if found is None:
            bad += bool(line.strip())
        else:
            out.append(found)
    return Claims(directory, out, [f"{path}: {bad} line(s) skipped"] if bad else [])
