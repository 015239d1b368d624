"""``jobgen submit SWEEP.toml``: every point's run directory, ``sweep.json`` and ONE array.

The sweep's directory is ``<runs_root>/<job.name>/``: ``sweep.json`` (the points, their
overrides and the files the claim reads), ``sweep.sbatch`` (jobgen.sweep_render), one run
directory per point, and the claims (jobgen.sweep_claim). The array is
``--array=1-TASKS%max_parallel``; TASKS is job.array for every point still open, so each
point has as many tasks as a single run of it would. Submitting again never changes a
point that exists: points newly written into the file are added, unfinished ones continue
(a failed one is retried, as a single run's resubmission is), finished ones are left alone.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobgen import slurm
from jobgen.atomic import write_json_atomic, write_text_atomic
from jobgen.preflight import Finding, command_findings, memory_findings, pass_env_findings, preflight
from jobgen.render import render
from jobgen.rundir import RunDir, materialize, remove_new
from jobgen.submit import SubmitError, clear_failure
from jobgen.submit import quarantined_nodes as _quarantined_run
from jobgen.sweep_claim import SWEEP_INDEX, closed_reason
from jobgen.sweep_points import Sweep, SweepPoint
from jobgen.sweep_render import SWEEP_SCRIPT, render_sweep

# Slurm's default MaxArraySize is 1001: indices 1-1000.
MAX_TASKS = 1000


@dataclass
class SweepSubmitResult:
    directory: Path
    script: Path
    command: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    new_points: list[str] = field(default_factory=list)
    kept_points: list[str] = field(default_factory=list)
    tasks: int = 0
    job_id: int | None = None


def read_index(directory: Path) -> dict[str, Any] | None:
    """sweep.json, or None where there is none (not a sweep, or not submitted yet)."""
    path = directory / SWEEP_INDEX
    return json.loads(path.read_text()) if path.is_file() else None


def point_entry(point: SweepPoint) -> dict[str, Any]:
    """A point as sweep.json records it: what it is and every file the claim reads."""
    run = RunDir(point.spec.run_dir)
    return {
        "name": point.name,
        "overrides": point.overrides,
        "dir": str(run.path),
        "script": str(run.script(point.spec.run.job.program)),
        "log": str(run.batch_log(point.name, "{job_id}")),
        "done": str(run.done_marker),
        "failed": str(run.failed_marker),
        "kill": str(run.switch("kill")),
        "attempts": point.spec.run.job.array,
    }


def _findings(sweep: Sweep, new: list[SweepPoint], *, ignore_memory_plan: bool) -> list[Finding]:
    """The memory plan and the program's checks of every new point, named by the point."""
    out = []
    for point in new:
        spec = point.spec
        for f in memory_findings(spec, ignore=ignore_memory_plan) + pass_env_findings(spec) + command_findings(spec):
            out.append(Finding(f.level, f.key, f"point {point.name}: {f.message}"))
    return out


def _busy(index: dict[str, Any] | None) -> list[slurm.QueueEntry]:
    ids = [int(j["job_id"]) for j in (index or {}).get("jobs", [])]
    return slurm.queue(ids) if ids else []


def _open_tasks(entries: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """Tasks the array needs (job.array for each open point) and the closed points' words."""
    tasks, closed = 0, []
    for entry in entries:
        # Counted afresh: a new array gives every point its tasks again (jobgen.sweep_claim
        # counts the claims of its own array only), and a failed point is retried.
        reason = closed_reason(entry, used=0)
        if reason is None or reason == "failed":
            tasks += int(entry["attempts"])
        else:
            closed.append(f"{entry['name']} ({reason})")
    return min(tasks, MAX_TASKS), closed


def _quarantined(point: Path) -> list[str]:
    """The nodes a point quarantined (jobgen.submit._quarantined for a point's directory)."""
    return _quarantined_run(point) if point.is_dir() else []


def submit_sweep(
    sweep: Sweep,
    *,
    source_text: str | None,
    after: int | None = None,
    dry_run: bool = False,
    skip_preflight: bool = False,
    ignore_memory_plan: bool = False,
) -> SweepSubmitResult:
    """Check, then write the new points and the index, then queue the array. Raises
    SubmitError with every finding when one is an error; nothing is written then."""
    index = read_index(sweep.directory)
    known = {p["name"]: p for p in (index or {}).get("points", [])}
    new = [p for p in sweep.points if p.name not in known]
    entries = [*known.values(), *(point_entry(p) for p in new)]
    tasks, closed = _open_tasks(entries)
    script = render_sweep(sweep)
    options = [f"--array=1-{max(tasks, 1)}%{sweep.settings.max_parallel}"]
    quarantined = sorted({n for e in known.values() for n in _quarantined(Path(e["dir"]))})
    if quarantined:  # as a run's resubmission does: the nodes its points found at fault
        excluded = [*sweep.base.run.job.exclude, *(n for n in quarantined if n not in sweep.base.run.job.exclude)]
        options.append("--exclude=" + ",".join(excluded))
    if after is not None:
        options.append(f"--dependency=afterany:{after}")
    result = SweepSubmitResult(sweep.directory, sweep.directory / SWEEP_SCRIPT, new_points=[p.name for p in new])
    result.kept_points, result.tasks = [n for n in known if n not in result.new_points], tasks
    result.command = ["sbatch", "--parsable", *options, str(result.script)]
    findings = _findings(sweep, new, ignore_memory_plan=ignore_memory_plan)
    if closed:
        findings.append(Finding("info", "", f"left as they are: {', '.join(closed)}"))
    if tasks == 0:
        findings.append(Finding("error", "", "nothing to run: every point of the sweep is finished or stopped"))
    if after is None and index is not None:
        busy = _busy(index)
        if busy:
            findings.append(
                Finding(
                    "error",
                    "",
                    f"sweep {sweep.directory} still has job {busy[0].array_job_id} ({busy[0].state}): chain with "
                    f"--after {busy[0].array_job_id}, or stop it first (jobgen stop {sweep.name})",
                )
            )
    if not skip_preflight and not any(f.level == "error" for f in findings):
        with tempfile.TemporaryDirectory(prefix="jobgen-preflight-") as tmp:
            candidate = Path(tmp) / SWEEP_SCRIPT
            candidate.write_text(script)
            findings += preflight(sweep.base, candidate, options)
    result.findings = findings
    if any(f.level == "error" for f in findings):
        raise SubmitError(findings)
    if dry_run:
        return result
    result.job_id = _queue(sweep, new, entries, index, script, source_text, options)
    return result


def _queue(
    sweep: Sweep,
    new: list[SweepPoint],
    entries: list[dict[str, Any]],
    index: dict[str, Any] | None,
    script: str,
    source_text: str | None,
    options: list[str],
) -> int:
    """Write the new points, the index and the script, then sbatch. When sbatch fails, the
    points this submission created are removed and the index is as it was."""
    (sweep.directory / "logs").mkdir(parents=True, exist_ok=True)
    created: list[RunDir] = []
    jobs = list((index or {}).get("jobs", []))
    try:
        for point in new:
            run, _ = materialize(point.spec, render(point.spec), source_text, new_only=True)
            created.append(run)
        for entry in entries:
            if entry["name"] not in {p.name for p in new}:
                clear_failure(RunDir(Path(entry["dir"])))
        body = {"format": 1, "name": sweep.name, "max_parallel": sweep.settings.max_parallel, "points": entries}
        write_json_atomic(sweep.directory / SWEEP_INDEX, {**body, "jobs": jobs})
        script_path = sweep.directory / SWEEP_SCRIPT
        write_text_atomic(script_path, script, mode=0o777)
        job_id = slurm.sbatch(script_path, options)
    except BaseException:
        for run in created:
            remove_new(run)
        if index is not None:
            write_json_atomic(sweep.directory / SWEEP_INDEX, index)
        else:
            (sweep.directory / SWEEP_INDEX).unlink(missing_ok=True)
        raise
    jobs.append({"job_id": job_id, "options": options})
    write_json_atomic(sweep.directory / SWEEP_INDEX, {**body, "jobs": jobs})
    return job_id
