"""``jobgen status SWEEP``: one line per point (its overrides, state, step, loss and best
eval loss), from sweep.json, each point's run directory, the claims and one ``squeue``.

A point is ``running`` while the task that claimed it runs, ``finished``/``failed`` by its
markers, ``stopped`` by its kill switch (or when no job of the sweep is left to run it), and
``pending`` while the sweep's array is queued and will come to it. ``jobgen status
SWEEP/POINT`` is a run's status, with the tasks that ran that point.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jobgen.report.compare import read_row, sweep_points
from jobgen.runs.rundir import RunDir, startup_switch_set
from jobgen.runs.sweep_files import Claim, read_claims
from jobgen.runs.sweep_runs import read_sweep
from jobgen.slurm import client as slurm


def _live(jobs: list[int]) -> tuple[list[slurm.QueueEntry], str | None]:
    """The sweep's tasks Slurm still holds, or why Slurm could not be asked."""
    try:
        return (slurm.queue(jobs) if jobs else []), None
    except slurm.SlurmUnavailable as exc:
        return [], f"Slurm not reachable ({exc}): states from the sweep's directory only"


def point_state(run: RunDir, claim: Claim | None, running: set[int], queued: bool | None) -> str:
    """``queued``: whether the sweep has a task in Slurm's queue (None: Slurm did not answer)."""
    if run.done_marker.exists():
        return "finished"
    if run.failed_marker.exists():
        return "failed"
    if startup_switch_set(run) is None and queued is None:
        return "unknown"
    if claim is not None and int(claim.job_id) in running:
        return "running"
    if startup_switch_set(run) or not queued:
        return "stopped"
    return "pending"


def sweep_state(states: list[str]) -> str:
    if not states or all(s == "finished" for s in states):
        return "finished"
    for state in ("running", "pending", "unknown"):
        if state in states:
            return state
    return "failed" if "failed" in states else "stopped"


def sweep_status(directory: Path) -> dict[str, Any]:
    """The sweep's state and one entry per point (``jobgen status SWEEP --json``)."""
    index = read_sweep(directory)
    jobs = [job.job_id for job in index.jobs]
    entries, problem = _live(jobs)
    running = {e.job_id for e in entries if e.state not in slurm.JOB_PENDING}
    queued = None if problem else bool(entries)
    claims = read_claims(directory)
    points = []
    for target in sweep_points(directory):
        run = RunDir(target.path)
        claim = claims.current(target.name)
        row = read_row(target, warn=lambda message: None)
        if run.exists():
            state = point_state(run, claim, running, queued)
        else:  # written into the file, not submitted yet
            state = "unknown" if queued is None else "pending" if queued else "stopped"
        task = (claim.array_job_id, claim.task) if claim else (None, None)
        points.append(
            {
                "name": target.name,
                "run_dir": str(run.path),
                "overrides": target.overrides,
                "state": state,
                "step": row.step,
                "max_steps": row.max_steps,
                "loss": row.final_loss,
                "best_eval_loss": row.best_eval_loss,
                "best_eval_step": row.best_eval_step,
                "task": f"{task[0]}_{task[1]}" if state == "running" else None,
            }
        )
    notes = [problem] if problem else []
    notes += [f"not a claim, skipped: {what}" for what in dict.fromkeys(claims.skipped)]
    return {
        "sweep_dir": str(directory),
        "name": index.name,
        "state": sweep_state([p["state"] for p in points]),
        "max_parallel": index.max_parallel,
        "jobs": jobs,
        "notes": notes,
        "points": points,
    }


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def format_sweep_status(status: dict[str, Any]) -> str:
    """The sweep's block: a header, then a table of its points."""
    head = (
        f"sweep {status['name']}: {status['state']}, {len(status['points'])} point(s), "
        f"at most {status['max_parallel']} at once, job(s) {', '.join(map(str, status['jobs'])) or 'none'}"
    )
    rows = [("point", "state", "step", "loss", "best eval", "overrides")]
    for p in status["points"]:
        step = "-" if p["step"] is None else f"{p['step']}/{p['max_steps'] or '?'}"
        best = _number(p["best_eval_loss"]) + (f" @{p['best_eval_step']}" if p["best_eval_step"] is not None else "")
        state = p["state"] + (f" ({p['task']})" if p["task"] else "")
        words = ", ".join(f"{k}={json.dumps(v)}" for k, v in p["overrides"].items())
        rows.append((p["name"], state, step, _number(p["loss"]), best, words))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [head, *("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)]
    lines += [f"  note: {n}" for n in status["notes"]]
    return "\n".join(lines)
