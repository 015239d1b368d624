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

import os
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
from jobgen.sweep_claim import SWEEP_INDEX, closed_reason, locked
from jobgen.sweep_points import Sweep, SweepPoint, allocation, overrides_key
from jobgen.sweep_render import SWEEP_SCRIPT, render_sweep
from jobgen.sweep_runs import SweepError, read_sweep

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
    """sweep.json, or None where there is none (not submitted yet). One that cannot be read
    refuses the submission, naming it: the points it lists would be lost."""
    if not (directory / SWEEP_INDEX).is_file():
        return None
    try:
        return read_sweep(directory)
    except SweepError as exc:
        raise SubmitError([Finding("error", "", str(exc))]) from None


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


def _open_tasks(entries: list[dict[str, Any]]) -> tuple[int, int, list[str]]:
    """Tasks the array needs (job.array for each open point), the open points, and the
    closed points' words."""
    tasks, open_points, closed = 0, 0, []
    for entry in entries:
        # Counted afresh: a new array gives every point its tasks again (jobgen.sweep_claim
        # counts the claims of its own array only), and a failed point is retried.
        reason = closed_reason(entry, used=0)
        if reason is None or reason == "failed":
            tasks += int(entry["attempts"])
            open_points += 1
        else:
            closed.append(f"{entry['name']} ({reason})")
    return tasks, open_points, closed


def _match(sweep: Sweep, index: dict[str, Any] | None) -> tuple[list[dict[str, Any]], list[SweepPoint], list[Finding]]:
    """The points the sweep has (sweep.json), the file's points it does not have yet, and the
    problems. A point is the same point when its overrides are: a name that changed because
    other points came (a shorter key no longer unique) keeps the point it names."""
    known = list((index or {}).get("points", []))
    by_overrides = {overrides_key(p.get("overrides") or {}) for p in known}
    names = {p["name"] for p in known}
    new = [p for p in sweep.points if overrides_key(p.overrides) not in by_overrides]
    findings = [
        Finding("error", "sweep", f"point {p.name}: the sweep already has a point of that name with other overrides")
        for p in new
        if p.name in names
    ]
    return known, new, findings


def _kept_problems(sweep: Sweep, known: list[dict[str, Any]]) -> list[Finding]:
    """Points the sweep has whose allocation the file's base no longer asks for: the array's
    tasks would not fit their scripts (another node count, partition, time...)."""
    wanted, out = allocation(sweep.base), []
    for entry in known:
        try:
            have = allocation(RunDir(Path(entry["dir"])).load_spec())
        except (OSError, ValueError) as exc:
            out.append(Finding("error", "", f"point {entry['name']}: cannot read its spec.json: {exc}"))
            continue
        if have != wanted:
            diff = sorted(set(have) ^ set(wanted))
            out.append(
                Finding(
                    "error",
                    "job",
                    f"point {entry['name']} was submitted asking Slurm for what the file no longer asks "
                    f"({', '.join(diff)}): one array asks the same of every task; start a new sweep (another "
                    "job.name) for the new allocation",
                )
            )
    return out


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
    known, new, findings = _match(sweep, index)
    entries = [*known, *(point_entry(p) for p in new)]
    tasks, open_points, closed = _open_tasks(entries)
    quarantined = sorted({n for e in known for n in _quarantined(Path(e["dir"]))})
    options = _options(sweep, min(tasks, MAX_TASKS), open_points, quarantined, after)
    result = SweepSubmitResult(sweep.directory, sweep.directory / SWEEP_SCRIPT, new_points=[p.name for p in new])
    result.kept_points, result.tasks = [e["name"] for e in known], min(tasks, MAX_TASKS)
    result.command = ["sbatch", "--parsable", *options, str(result.script)]
    findings += _kept_problems(sweep, known) + _findings(sweep, new, ignore_memory_plan=ignore_memory_plan)
    findings += _sweep_findings(sweep, index, tasks, closed, after)
    script = render_sweep(sweep)
    if not skip_preflight and not any(f.level == "error" for f in findings):
        with tempfile.TemporaryDirectory(prefix="jobgen-preflight-") as tmp:
            candidate = Path(tmp) / SWEEP_SCRIPT
            candidate.write_text(script)
            findings += preflight(sweep.base, candidate, options, quarantined)
    result.findings = findings
    if any(f.level == "error" for f in findings):
        raise SubmitError(findings)
    if dry_run:
        return result
    result.job_id = _queue(sweep, new, entries, index, script, source_text, options)
    return result


def _options(sweep: Sweep, tasks: int, open_points: int, quarantined: list[str], after: int | None) -> list[str]:
    """sbatch's options: the array (at most K at once, and no more than the points open: a
    task beyond them would only wait for one), the quarantined nodes, the dependency."""
    options = [f"--array=1-{max(tasks, 1)}%{max(1, min(sweep.settings.max_parallel, open_points))}"]
    if quarantined:  # as a run's resubmission does: the nodes its points found at fault
        exclude = sweep.base.run.job.exclude
        options.append("--exclude=" + ",".join([*exclude, *(n for n in quarantined if n not in exclude)]))
    if after is not None:
        options.append(f"--dependency=afterany:{after}")
    return options


def _sweep_findings(
    sweep: Sweep, index: dict[str, Any] | None, tasks: int, closed: list[str], after: int | None
) -> list[Finding]:
    """What the sweep as a whole says: points left alone, nothing to run, too many tasks, a
    single run's directory in the way, an array still queued."""
    out = [Finding("info", "", f"left as they are: {', '.join(closed)}")] if closed else []
    if tasks == 0:
        out.append(Finding("error", "", "nothing to run: every point of the sweep is finished or stopped"))
    if tasks > MAX_TASKS:
        out.append(
            Finding(
                "error",
                "job.array",
                f"the open points need {tasks} tasks (job.array for each); one Slurm array holds at most "
                f"{MAX_TASKS}: lower job.array or split the sweep",
            )
        )
    if (sweep.directory / "spec.json").exists():
        out.append(Finding("error", "job.name", f"{sweep.directory} is a single run's directory: use another job.name"))
    busy = _busy(index) if after is None and index is not None else []
    if busy:
        out.append(
            Finding(
                "error",
                "",
                f"sweep {sweep.directory} still has job {busy[0].array_job_id} ({busy[0].state}): chain with "
                f"--after {busy[0].array_job_id}, or stop it first (jobgen stop {sweep.name})",
            )
        )
    return out


def _queue(
    sweep: Sweep,
    new: list[SweepPoint],
    entries: list[dict[str, Any]],
    index: dict[str, Any] | None,
    script: str,
    source_text: str | None,
    options: list[str],
) -> int:
    """Write the new points, the index and the script, then sbatch, under the sweep's lock:
    a submission that finds the index changed since it looked (another one of the same sweep)
    is refused. When sbatch fails, the points this submission created are removed and the
    index is as it was."""
    (sweep.directory / "logs").mkdir(parents=True, exist_ok=True)
    with locked(sweep.directory):
        if read_index(sweep.directory) != index:
            raise SubmitError([Finding("error", "", f"another submission changed {sweep.directory}: submit again")])
        created: list[RunDir] = []
        jobs = list((index or {}).get("jobs", []))
        body = {"format": 1, "name": sweep.name, "max_parallel": sweep.settings.max_parallel, "points": entries}
        cleared: list[tuple[RunDir, Path]] = []
        try:
            for point in new:
                run, _ = materialize(point.spec, render(point.spec), source_text, new_only=True)
                created.append(run)
            # The resubmission is the user's word that the failures are fixed (as for a run);
            # before sbatch: a task may claim at once.
            for entry in entries[: len(entries) - len(new)]:  # the points the sweep had
                moved = clear_failure(RunDir(Path(entry["dir"])))
                if moved is not None:
                    cleared.append((RunDir(Path(entry["dir"])), moved))
            write_json_atomic(sweep.directory / SWEEP_INDEX, {**body, "jobs": jobs})
            script_path = sweep.directory / SWEEP_SCRIPT
            write_text_atomic(script_path, script, mode=0o777)
            job_id = slurm.sbatch(script_path, options)
        except BaseException:
            for run in created:
                remove_new(run)
            for run, moved in cleared:
                os.replace(moved, run.failed_marker)
            if index is not None:
                write_json_atomic(sweep.directory / SWEEP_INDEX, index)
            else:
                (sweep.directory / SWEEP_INDEX).unlink(missing_ok=True)
            raise
        jobs.append({"job_id": job_id, "options": options})
        write_json_atomic(sweep.directory / SWEEP_INDEX, {**body, "jobs": jobs})
    return job_id
