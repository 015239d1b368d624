"""Which point of a sweep an array task runs: the claim the sweep's batch script makes first.

    python -m jobgen.sweep_claim --sweep DIR --job "$SLURM_JOB_ID" \\
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
a single run's array task does. sweep.json names every file this reads.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jobgen import slurm  # its table of job states
from jobgen.atomic import write_json_atomic

SWEEP_INDEX = "sweep.json"  # the sweep's points and the files each claim reads
# A job that still holds its point: it runs, or is ending (its processes may still write the
# point's checkpoint). A pending job (a requeued one) claims again when it starts.
HOLDING_STATES = slurm.JOB_ACTIVE - slurm.JOB_PENDING
Alive = Callable[[str], bool]


@contextmanager
def locked(sweep: Path) -> Iterator[None]:
    """flock on the sweep's lock file: one task at a time reads and writes the claims."""
    with open(sweep / ".claims.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_claims(sweep: Path) -> list[dict[str, Any]]:
    """Every claim ever made (claims.jsonl), oldest first; a torn last line is skipped."""
    path = sweep / "claims.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def current_claim(sweep: Path, point: str) -> dict[str, Any] | None:
    try:
        return json.loads((sweep / "claims" / f"{point}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


# The switches that keep a run's tasks from starting (jobgen.rundir.STARTUP_SWITCHES), by the
# name of their file next to the kill switch that sweep.json names.
STARTUP_SWITCH_NAMES = ("kill", "abort")


def stopped_by(kill_switch: Path) -> str | None:
    """The startup switch set on a point (a regular file, not a link), or None."""
    for name in STARTUP_SWITCH_NAMES:
        path = kill_switch.with_name(name)
        if path.is_file() and not path.is_symlink():
            return name
    return None


def closed_reason(point: dict[str, Any], used: int) -> str | None:
    """Why a point takes no more tasks, or None while it is open."""
    if Path(point["done"]).exists():
        return "finished"
    if Path(point["failed"]).exists():
        return "failed"
    switch = stopped_by(Path(point["kill"]))
    if switch is not None:
        return f"stopped ({switch} switch)"
    if used >= int(point["attempts"]):
        return f"out of tasks ({used} of {point['attempts']})"
    return None


def holder(sweep: Path, point: str, job_id: str, alive: Alive) -> str | None:
    """The live task holding ``point``, or None. This job's own earlier attempt (same id,
    requeued) holds nothing: nothing from an earlier attempt is acted on."""
    claim = current_claim(sweep, point)
    if claim is None or str(claim["job_id"]) == job_id:
        return None
    return str(claim["job_id"]) if alive(str(claim["job_id"])) else None


def choose(
    sweep: Path, index: dict[str, Any], job_id: str, array_job: str, alive: Alive
) -> tuple[dict | None, int, int]:
    """The point to run (or None), how many points are still open, and how many of those
    are held by other live tasks."""
    # Tasks of this array only: a re-submission gives every open point job.array tasks again.
    # A job requeued (same id) is one task, as it is one index of the array.
    jobs: dict[str, set[str]] = {}
    for claim in read_claims(sweep):
        if str(claim.get("array_job_id")) == array_job:
            jobs.setdefault(claim["point"], set()).add(str(claim.get("job_id")))
    used = {point: len(ids) for point, ids in jobs.items()}
    best, best_used, open_points, held = None, 0, 0, 0
    for point in index["points"]:
        if "script" not in point:  # written into the file, not submitted yet
            continue
        count = used.get(point["name"], 0)
        if closed_reason(point, count) is not None:
            continue
        open_points += 1
        if holder(sweep, point["name"], job_id, alive) is not None:
            held += 1
            continue
        if best is None or count < best_used:
            best, best_used = point, count
    return best, open_points, held


def record_claim(sweep: Path, point: str, args: argparse.Namespace) -> None:
    claim = {
        "point": point,
        "job_id": args.job,
        "array_job_id": args.array_job or args.job,
        "task": args.task,
        "restart": args.restart,
        "time": time.time(),
    }
    (sweep / "claims").mkdir(exist_ok=True)
    # A requeued job that now takes another point gives up the one its earlier attempt held.
    for path in (sweep / "claims").glob("*.json"):
        if path.name != f"{point}.json" and str((current_claim(sweep, path.stem) or {}).get("job_id")) == str(args.job):
            path.unlink(missing_ok=True)
    write_json_atomic(sweep / "claims" / f"{point}.json", claim)
    with open(sweep / "claims.jsonl", "a") as handle:
        handle.write(json.dumps(claim) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def claim(sweep: Path, args: argparse.Namespace, alive: Alive) -> tuple[dict[str, Any] | None, int, int]:
    """Take a point for this task: its entry of sweep.json (or None), the points still open and
    how many of them other live tasks hold."""
    with locked(sweep):
        index = json.loads((sweep / SWEEP_INDEX).read_text())
        point, open_points, held = choose(sweep, index, str(args.job), str(args.array_job or args.job), alive)
        if point is not None:
            record_claim(sweep, point["name"], args)
    return point, min(int(index["max_parallel"]), open_points), held


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobgen.sweep_claim", description=__doc__.splitlines()[0])
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
    point, throttle, held = claim(args.sweep, args, lambda job: args.live_unknown or job in live)
    if point is None:
        print(f"{'held' if held else 'none'} {throttle}")
        return 0
    print(f"claimed {throttle}")
    print(point["dir"])
    print(point["script"])
    print(point["log"].replace("{job_id}", str(args.job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
