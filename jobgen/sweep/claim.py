"""Which point of a sweep an array task runs: the claim the sweep's batch script makes first.

    python -m jobgen.sweep.claim --sweep DIR --job "$SLURM_JOB_ID" \\
        --array-job "$SLURM_ARRAY_JOB_ID" --task "$SLURM_ARRAY_TASK_ID" \\
        --restart "${SLURM_RESTART_COUNT:-0}" --live JOBID,JOBID...   # or --live-unknown

prints ``claimed N`` and the chosen point's directory, script and batch log (one line
each), or ``held N`` (every open point is held by a live task: the script asks again) or
``none N`` (nothing left); N is the array's throttle to set, min(max_parallel, open
points), 0 when none is open (the script then cancels the pending tasks).

A sweep is one Slurm array ``--array=1-M%K``: its tasks are workers, not points. Each task
takes, under a lock on the sweep directory, the point that is neither finished, failed,
stopped, out of tasks nor held by a live task, with the fewest tasks so far (ties: the order
of sweep.json), so K points advance in turn and a point never runs twice at once. ``--live``
is the array's tasks Slurm still runs or is ending (the batch script asks squeue, on the
node: a container image may have no Slurm client); ``--live-unknown`` (squeue failed) counts
every claim as live.

The task decides once, here, on the batch node; the point's own script then runs exactly as
a single run's array task does. Every path is derived from ``--sweep`` and a point's name
(jobgen.runs.sweep_files), never read from a file; a claim line that cannot be read is skipped,
and the claim says on stderr (the array's log) how many it skipped. A sweep.json that cannot
be read is one line on stderr and exit status 2: nothing is claimed from an index this
cannot trust.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from jobgen.base.atomic import write_json_atomic
from jobgen.base.lease import exclusive
from jobgen.runs.rundir import RunDir, startup_switch_set
from jobgen.runs.sweep_files import (
    CLAIMS_DIR,
    CLAIMS_LOG,
    LOCK_FILE,
    Claim,
    Claims,
    PointEntry,
    SweepFileError,
    SweepIndex,
    read_claims,
    read_index,
)
from jobgen.slurm import client as slurm  # its table of job states

# A job that still holds its point: it runs, or is ending (its processes may still write the
# point's checkpoint). A pending job (a requeued one) claims again when it starts.
HOLDING_STATES = slurm.JOB_ACTIVE - slurm.JOB_PENDING
Alive = Callable[[str], bool]


def locked(sweep: Path) -> AbstractContextManager[None]:
    """flock on the sweep's lock file: one task at a time reads and writes the claims."""
    return exclusive(sweep / LOCK_FILE)


def closed_reason(run: RunDir, attempts: int, used: int) -> str | None:
    """Why a point takes no more tasks, or None while it is open."""
    if run.done_marker.exists():
        return "finished"
    if run.failed_marker.exists():
        return "failed"
    switch = startup_switch_set(run)
    if switch is not None:
        return f"stopped ({switch} switch)"
    if used >= attempts:
        return f"out of tasks ({used} of {attempts})"
    return None


def holder(claims: Claims, point: str, job_id: str, alive: Alive) -> str | None:
    """The live task holding ``point``, or None. This job's own earlier attempt (same id,
    requeued) holds nothing: nothing from an earlier attempt is acted on."""
    current = claims.current(point)
    if current is None or current.job_id == job_id:
        return None
    return current.job_id if alive(current.job_id) else None


def choose(
    index: SweepIndex, claims: Claims, job_id: str, array_job: str, alive: Alive
) -> tuple[PointEntry | None, int, int]:
    """The point to run (or None), how many points are still open, and how many of those
    are held by other live tasks."""
    # Tasks of this array only: a re-submission gives every open point job.array tasks again.
    # A job requeued (same id) is one task, as it is one index of the array.
    jobs: dict[str, set[str]] = {}
    for past in claims.log:
        if past.array_job_id == array_job:
            jobs.setdefault(past.point, set()).add(past.job_id)
    best, best_used, open_points, held = None, 0, 0, 0
    for point in index.points:
        run = index.run(point)
        if point.program is None or not run.exists():  # written into the file, not submitted yet
            continue
        count = len(jobs.get(point.name, ()))
        if closed_reason(run, point.attempts, count) is not None:
            continue
        open_points += 1
        if holder(claims, point.name, job_id, alive) is not None:
            held += 1
            continue
        if best is None or count < best_used:
            best, best_used = point, count
    return best, open_points, held


def record_claim(sweep: Path, claims: Claims, point: str, args: argparse.Namespace) -> None:
    claim = Claim(
        point=point,
        job_id=str(args.job),
        array_job_id=str(args.array_job or args.job),
        task=str(args.task),
        restart=args.restart,
        time=time.time(),
    )
    for path in (sweep / CLAIMS_DIR, sweep / CLAIMS_LOG):  # written here: never through a link
        if path.is_symlink():
            raise SweepFileError(path, "is a symbolic link: a sweep's claims are files of its own")
    (sweep / CLAIMS_DIR).mkdir(exist_ok=True)
    # A requeued job that now takes another point gives up the one its earlier attempt held.
    for path in (sweep / CLAIMS_DIR).glob("*.json"):
        held = claims.current(path.stem)
        if path.stem != point and held is not None and held.job_id == claim.job_id:
            path.unlink(missing_ok=True)
    write_json_atomic(sweep / CLAIMS_DIR / f"{point}.json", claim.to_json())
    with open(sweep / CLAIMS_LOG, "a") as handle:
        handle.write(json.dumps(claim.to_json()) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@dataclass(frozen=True)
class Outcome:
    """What a task's claim decided."""

    point: PointEntry | None  # the point taken, or None
    run: RunDir | None  # its run directory
    throttle: int  # min(max_parallel, open points): the array's throttle to set
    held: int  # open points held by other live tasks
    skipped: list[str] = field(default_factory=list)  # what could not be read, and was skipped


def claim(sweep: Path, args: argparse.Namespace, alive: Alive) -> Outcome:
    """Take a point for this task. Raises SweepFileError for a sweep.json that cannot be read."""
    with locked(sweep):
        index = read_index(sweep)
        claims = read_claims(sweep)
        point, open_points, held = choose(index, claims, str(args.job), str(args.array_job or args.job), alive)
        if point is not None:
            record_claim(sweep, claims, point.name, args)
    skipped = list(dict.fromkeys(claims.skipped))
    run = index.run(point) if point is not None else None
    return Outcome(point, run, min(index.max_parallel, open_points), held, skipped)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobgen.sweep.claim", description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=Path, required=True, help="the sweep's directory (holds sweep.json)")
    parser.add_argument("--job", required=True, help="$SLURM_JOB_ID")
    parser.add_argument("--array-job", default="", help="$SLURM_ARRAY_JOB_ID")
    parser.add_argument("--task", default="", help="$SLURM_ARRAY_TASK_ID")
    parser.add_argument("--restart", type=int, default=0, help="$SLURM_RESTART_COUNT")
    live = parser.add_mutually_exclusive_group(required=True)
    live.add_argument(
        "--live", default=None, help="job ids of the array's tasks that run or are ending, comma-separated"
    )
    live.add_argument("--live-unknown", action="store_true", help="Slurm did not answer: every claim is live")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    live = {j for j in (args.live or "").split(",") if j}
    try:
        outcome = claim(args.sweep, args, lambda job: args.live_unknown or job in live)
    except SweepFileError as exc:
        print(f"jobgen.sweep.claim: {exc}", file=sys.stderr)
        return 2
    for what in outcome.skipped:  # the claim went on without them
        print(f"jobgen.sweep.claim: not a claim, skipped: {what}", file=sys.stderr)
    point, run = outcome.point, outcome.run
    if point is None or run is None or point.program is None:
        print(f"{'held' if outcome.held else 'none'} {outcome.throttle}")
        return 0
    print(f"claimed {outcome.throttle}")
    print(run.path)
    print(run.script(point.program))
    print(run.batch_log(point.name, args.job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
