"""Finding a sweep and its points on disk, and what Slurm calls a point's tasks.

A sweep's directory holds ``sweep.json`` and one run directory per point; ``SWEEP`` in a
command is the sweep's name under the runs root or its directory, ``SWEEP/POINT`` one point
(a run like any other). A point's tasks are tasks of the sweep's array that claimed it
(jobgen.sweep_claim): Slurm knows them by the sweep's job name and their own job ids, so
``jobgen status`` of a point asks for those, not for jobs named after the point.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jobgen.rundir import KILL_SWITCH, RunDir, RunDirError, find_run
from jobgen.sweep_claim import SWEEP_INDEX, read_claims, stopped_by


class SweepError(RuntimeError):
    """A sweep reference that names no sweep, or a sweep.json that cannot be read."""


def is_sweep_dir(path: Path) -> bool:
    return (path / SWEEP_INDEX).is_file()


def find_sweep(ref: str, runs_root: Path | None) -> Path | None:
    """The sweep directory ``ref`` names (its directory, or its name under the runs root),
    or None when it names none."""
    as_path = Path(ref).expanduser()
    if is_sweep_dir(as_path):
        return as_path.absolute()
    if runs_root is not None and "/" not in ref and is_sweep_dir(runs_root / ref):
        return runs_root / ref
    return None


def find_point(ref: str, runs_root: Path | None) -> RunDir | None:
    """``SWEEP/POINT`` under the runs root, when it is a point's run directory."""
    parts = ref.split("/")
    if runs_root is None or len(parts) != 2 or any(p in ("", ".", "..") for p in parts):
        return None
    path = runs_root / parts[0] / parts[1]
    return RunDir(path) if is_sweep_dir(path.parent) and (path / "spec.json").is_file() else None


def find_run_or_point(ref: str, runs_root: Path | None) -> RunDir:
    """jobgen.rundir.find_run, where ``SWEEP/POINT`` names a sweep's point too (a run like any
    other); find_run's RunDirError when ``ref`` names neither."""
    try:
        return find_run(ref, runs_root)
    except RunDirError:
        point = find_point(ref, runs_root)
        if point is None:
            raise
        return point


def read_sweep(directory: Path) -> dict[str, Any]:
    """sweep.json, checked for what every reader takes from it (raises SweepError naming the
    file: a hand edit or a cut write is a sentence, not a traceback)."""
    path = directory / SWEEP_INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SweepError(f"cannot read {path}: {exc}") from None
    points = index.get("points") if isinstance(index, dict) else None
    if not isinstance(points, list) or not all(
        isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("dir"), str) for p in points
    ):
        raise SweepError(f"{path} is not a sweep's index: it needs 'points', each with a 'name' and a 'dir'")
    if not all(isinstance(j, dict) and str(j.get("job_id", "")).isdigit() for j in index.get("jobs", [])):
        raise SweepError(f"{path}: 'jobs' must list objects with a numeric 'job_id'")
    return index


def point_runs(directory: Path) -> list[tuple[dict[str, Any], RunDir]]:
    """Each point of the sweep (its sweep.json entry) with its run directory, in order."""
    return [(p, RunDir(Path(p["dir"]))) for p in read_sweep(directory).get("points", [])]


def sweep_of(run: RunDir) -> Path | None:
    """The sweep directory ``run`` is a point of, or None for a single run."""
    return run.path.parent if is_sweep_dir(run.path.parent) else None


def sweep_name(run: RunDir) -> str | None:
    """The name of the sweep ``run`` is a point of (W&B's group), or None."""
    sweep = sweep_of(run)
    if sweep is None:
        return None
    try:
        return str(read_sweep(sweep).get("name") or sweep.name)
    except SweepError:
        return sweep.name


def point_claims(run: RunDir) -> list[dict[str, Any]]:
    """The claims of ``run`` (a point) by the sweep's tasks, oldest first."""
    sweep = sweep_of(run)
    return [c for c in read_claims(sweep) if c.get("point") == run.path.name] if sweep else []


def sweep_jobs(run: RunDir) -> list[int]:
    """The arrays of the sweep ``run`` is a point of (none for a single run)."""
    sweep = sweep_of(run)
    if sweep is None:
        return []
    try:
        return [int(j["job_id"]) for j in read_sweep(sweep).get("jobs", [])]
    except (SweepError, KeyError, TypeError, ValueError):
        return []


def point_open(run: RunDir) -> bool:
    """Whether a point may still be given a task: not finished, failed or stopped (kill or
    abort switch)."""
    return not (run.done_marker.exists() or run.failed_marker.exists() or stopped_by(run.switch(KILL_SWITCH)))


def slurm_view(run: RunDir, job_name: str) -> tuple[str, set[int] | None]:
    """The job name Slurm knows the run's tasks by, and for a point the job ids of the
    tasks that ran it (None: every job of that name that the run submitted)."""
    name = sweep_name(run)
    if name is None:
        return job_name, None
    return name, {int(c["job_id"]) for c in point_claims(run) if str(c.get("job_id", "")).isdigit()}
