"""Which point of a sweep an array task runs: the claim the sweep's batch script makes first.

    python -m jobgen.sweep_claim --sweep DIR --job "$SLURM_JOB_ID" \\
        --array-job "$SLURM_ARRAY_JOB_ID" --task "$SLURM_ARRAY_TASK_ID" --restart "${SLURM_RESTART_COUNT:-0}"

prints the chosen point's directory, script and batch log (three lines), or nothing when no
point is left to run. A sweep is one Slurm array ``--array=1-M%K``: its tasks are workers,
not points. Each task takes, under a lock on the sweep directory, the point that is neither
finished, failed, stopped, out of tasks nor held by a live task, with the fewest tasks so
far (ties: the order of sweep.json), so K points advance in turn and a point never runs
twice at once. Then it sets the array's throttle to min(K, points still open): once fewer
points are left than K, Slurm starts no task that would find nothing to do, and a sweep with
nothing left has its pending tasks cancelled instead of burning through them.

The task decides once, here, on the batch node; the point's own script then runs exactly as
a single run's array task does. Standard library and jobgen's Slurm client only: it runs
before the job's environment is set up (a container site runs it with the node's python3),
and sweep.json names every file it reads.
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

from jobgen import slurm
from jobgen.atomic import write_json_atomic

SWEEP_INDEX = "sweep.json"  # the sweep's points and the files each claim reads
# A job that still holds its point: it runs, or is ending (its processes may still write the
# point's checkpoint). A pending job (a requeued one) claims again when it starts.
HOLDING_STATES = slurm.JOB_ACTIVE - slurm.JOB_PENDING
# A task that finds every open point held waits this long for one to come free: the task that
# held it has just met its limit and Slurm is still ending it (KillWait is 30 s by default).
WAIT_FOR_FREE_S = 180.0
POLL_S = 5.0

Alive = Callable[[str], bool]


def slurm_job_alive(job_id: str) -> bool:
    """Whether Slurm still runs (or is ending) ``job_id``. Unsure (Slurm did not answer)
    counts as alive: two tasks on one point would be worse than a task that waits or leaves."""
    try:
        return any(e.job_id == int(job_id) and e.state in HOLDING_STATES for e in slurm.queue([int(job_id)]))
    except (slurm.SlurmError, ValueError):  # SlurmUnavailable is one
        return True


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


def closed_reason(point: dict[str, Any], used: int) -> str | None:
    """Why a point takes no more tasks, or None while it is open."""
    if Path(point["done"]).exists():
        return "finished"
    if Path(point["failed"]).exists():
        return "failed"
    kill = Path(point["kill"])
    if kill.is_file() and not kill.is_symlink():
        return "stopped"
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
    used: dict[str, int] = {}
    for claim in read_claims(sweep):
        if str(claim.get("array_job_id")) == array_job:
            used[claim["point"]] = used.get(claim["point"], 0) + 1
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
    write_json_atomic(sweep / "claims" / f"{point}.json", claim)
    with open(sweep / "claims.jsonl", "a") as handle:
        handle.write(json.dumps(claim) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def set_throttle(array_job: str, open_points: int, max_parallel: int) -> None:
    """At most min(K, open points) tasks at once; none left: cancel the pending ones."""
    if not array_job:
        return
    try:
        if open_points == 0:
            slurm.cancel(array_job, pending_only=True)
        else:
            slurm.update_job(array_job, ArrayTaskThrottle=str(min(max_parallel, open_points)))
    except slurm.SlurmError:  # SlurmUnavailable too
        pass  # the throttle only saves tasks; the claims stay right without it


def claim(sweep: Path, args: argparse.Namespace, alive: Alive = slurm_job_alive) -> dict[str, Any] | None:
    """Take a point for this task (waiting while every open point is held by a task that
    is ending), set the throttle, and return the point's entry of sweep.json."""
    deadline = time.monotonic() + args.wait
    while True:
        with locked(sweep):
            index = json.loads((sweep / SWEEP_INDEX).read_text())
            point, open_points, held = choose(sweep, index, str(args.job), str(args.array_job or args.job), alive)
            if point is not None:
                record_claim(sweep, point["name"], args)
        set_throttle(str(args.array_job or ""), open_points, int(index["max_parallel"]))
        if point is not None or held == 0 or time.monotonic() >= deadline:
            return point
        time.sleep(POLL_S)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobgen.sweep_claim", description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=Path, required=True, help="the sweep's directory (holds sweep.json)")
    parser.add_argument("--job", required=True, help="$SLURM_JOB_ID")
    parser.add_argument("--array-job", default="", help="$SLURM_ARRAY_JOB_ID")
    parser.add_argument("--task", default="", help="$SLURM_ARRAY_TASK_ID")
    parser.add_argument("--restart", type=int, default=0, help="$SLURM_RESTART_COUNT")
    parser.add_argument("--wait", type=float, default=WAIT_FOR_FREE_S, help="seconds to wait for a held point")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    point = claim(args.sweep, args)
    if point is not None:
        print(point["dir"])
        print(point["script"])
        print(point["log"].replace("{job_id}", str(args.job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
