"""Finding a sweep and its points on disk, and what Slurm calls a point's tasks.

A sweep's directory holds ``sweep.json`` and one run directory per point, ``points/<name>``
(jobgen.runs.sweep_files: sweeps of format 1 have them beside sweep.json); ``SWEEP`` in a command
is the sweep's name under the runs root or its directory, ``SWEEP/POINT`` one point (a run
like any other). A point's tasks are tasks of the sweep's array that claimed it
(jobgen.sweep.claim): Slurm knows them by the sweep's job name and their own job ids, so
``jobgen status`` of a point asks for those, not for jobs named after the point.

Every reader of sweep.json goes through :func:`read_sweep` (jobgen.runs.sweep_files.read_index):
one that cannot be read is a SweepFileError naming it, and a command that would act on the
sweep's points acts on none. What only describes a point (W&B's group, the job ids of its
tasks for ``jobgen status``) falls back to what the point's own directory and the claims say.
"""

from __future__ import annotations

import os
from pathlib import Path

from jobgen.base.visible import visible
from jobgen.runs.rundir import RunDir, RunDirError, find_run, startup_switch_set
from jobgen.runs.sweep_files import (
    POINTS_DIR,
    SWEEP_INDEX,
    Claim,
    PointEntry,
    SweepFileError,
    SweepIndex,
    is_point_name,
    read_claims,
    read_index,
)

# The name jobgen's commands catch: a sweep.json that cannot be read (a RunDirError too).
SweepError = SweepFileError


def is_sweep_dir(path: Path) -> bool:
    """A directory with an entry named sweep.json, whatever it is: one that is no file (a link,
    a FIFO, a directory) is then named by the sweep's reader, not taken for "no such run"."""
    return os.path.lexists(path / SWEEP_INDEX)


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
    """``SWEEP/POINT`` under the runs root, when POINT is a point of the sweep with a run
    directory; raises SweepFileError when the sweep's index cannot be read."""
    parts = ref.split("/")
    if runs_root is None or len(parts) != 2 or not is_point_name(parts[1]) or "/" in parts[0]:
        return None
    sweep = runs_root / parts[0]
    if parts[0] in ("", ".", "..") or not is_sweep_dir(sweep):
        return None
    index = read_sweep(sweep)
    if parts[1] not in {p.name for p in index.points}:
        return None
    run = RunDir(index.point_dir(parts[1]))
    # Anything at spec.json (a link, a FIFO) is the point's, named when it is read.
    return run if os.path.lexists(run.spec_file) else None


def find_run_or_point(ref: str, runs_root: Path | None) -> RunDir:
    """jobgen.runs.rundir.find_run, where ``SWEEP/POINT`` names a sweep's point too (a run like any
    other); find_run's RunDirError when ``ref`` names neither (a SweepFileError, which is one,
    when the sweep's index cannot be read)."""
    try:
        return find_run(ref, runs_root)
    except RunDirError:
        point = find_point(ref, runs_root)
        if point is not None:
            return point
        sweep_name_, _, name = ref.partition("/")
        sweep = find_sweep(sweep_name_, runs_root) if name and "/" not in name else None
        if sweep is None:
            raise
        index = read_sweep(sweep)  # a SweepFileError naming it when it cannot be read
        listed = name in {p.name for p in index.points}
        why = "has no directory yet" if listed else "is not one of its points"
        raise RunDirError(f"{visible(name)} {why} in sweep {sweep.name} ({sweep / SWEEP_INDEX})") from None


def read_sweep(directory: Path) -> SweepIndex:
    """sweep.json, validated: the one reader every command uses (raises SweepFileError)."""
    return read_index(directory)


def point_runs(directory: Path) -> list[tuple[PointEntry, RunDir]]:
    """Each point of the sweep (its sweep.json entry) with its run directory, in order: the
    directory derived from the sweep's own and the point's name (raises SweepFileError)."""
    index = read_sweep(directory)
    return [(entry, index.run(entry)) for entry in index.points]


def listed_points(root: Path) -> list[RunDir]:
    """The run directory of every sweep's point under the runs root (for the listing of
    runs), found on disk: a sweep whose index cannot be read still has its points listed,
    each then unreadable (:func:`point_problem`)."""
    found = [p.parent for p in root.glob(f"*/{POINTS_DIR}/*/spec.json") if is_sweep_dir(p.parent.parent.parent)]
    # Format 1: points beside sweep.json, in sweeps that have no points/.
    found += [
        p.parent
        for p in root.glob("*/*/spec.json")
        if is_sweep_dir(p.parent.parent) and not (p.parent.parent / POINTS_DIR).is_dir()
    ]
    return [RunDir(path) for path in found if not path.is_symlink()]


def sweep_of(run: RunDir) -> Path | None:
    """The sweep directory ``run`` is a point of, or None for a single run."""
    parent = run.path.parent
    if parent.name == POINTS_DIR and is_sweep_dir(parent.parent):
        return parent.parent
    return parent if is_sweep_dir(parent) else None


def point_problem(run: RunDir) -> str | None:
    """Why the status of ``run``, a sweep's point, cannot be trusted (its sweep's index cannot
    be read), in one line naming the file; None for a single run or a readable sweep."""
    sweep = sweep_of(run)
    if sweep is None:
        return None
    try:
        read_sweep(sweep)
    except SweepFileError as exc:
        return str(exc)
    return None


def sweep_name(run: RunDir) -> str | None:
    """The name of the sweep ``run`` is a point of (W&B's group), or None."""
    sweep = sweep_of(run)
    if sweep is None:
        return None
    try:
        return read_sweep(sweep).name
    except SweepFileError:
        return sweep.name  # the sweep's job.name is its directory's name


def point_claims(run: RunDir) -> list[Claim]:
    """The claims of ``run`` (a point) by the sweep's tasks, oldest first (lines that cannot
    be read skipped)."""
    sweep = sweep_of(run)
    if sweep is None:
        return []
    try:
        return read_claims(sweep).of(run.path.name)
    except SweepFileError:
        return []


def sweep_jobs(run: RunDir) -> list[int]:
    """The arrays of the sweep ``run`` is a point of (none for a single run, or when the
    sweep's index cannot be read: point_problem says so)."""
    sweep = sweep_of(run)
    if sweep is None:
        return []
    try:
        return [job.job_id for job in read_sweep(sweep).jobs]
    except SweepFileError:
        return []


def point_open(run: RunDir) -> bool:
    """Whether a point may still be given a task: not finished, failed or stopped (kill or
    abort switch)."""
    return not (run.done_marker.exists() or run.failed_marker.exists() or startup_switch_set(run))


def slurm_view(run: RunDir, job_name: str) -> tuple[str, set[int] | None]:
    """The job name Slurm knows the run's tasks by, and for a point the job ids of the
    tasks that ran it (None: every job of that name that the run submitted)."""
    name = sweep_name(run)
    if name is None:
        return job_name, None
    return name, {int(c.job_id) for c in point_claims(run)}
