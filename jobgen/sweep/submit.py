"""``jobgen submit SWEEP.toml``: every point's run directory, ``sweep.json`` and ONE array.

The sweep's directory is ``<runs_root>/<job.name>/`` (jobgen.runs.sweep_files): ``sweep.json``
(the points: their names, overrides, programs and tasks), ``sweep.sbatch``
(jobgen.sweep.render), one run directory per point under ``points/``, and the claims
(jobgen.sweep.claim). A sweep of format 1 (points beside sweep.json, jobgen before
``points/``) continues as it is: its points are continued and retried, and new points are
refused, since they would not be where its claim and its readers look. The array is
``--array=1-TASKS%max_parallel``; TASKS is job.array for every point still open, so each
point has as many tasks as a single run of it would. Submitting again never changes a
point that exists: points newly written into the file are added, unfinished ones continue
(a failed one is retried, as a single run's resubmission is), finished ones are left alone.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from jobgen.base.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from jobgen.launch.preflight import Finding, command_findings, memory_findings, pass_env_findings, preflight
from jobgen.launch.render import render
from jobgen.launch.submit import SubmitError, clear_failure
from jobgen.launch.submit import quarantined_nodes as _quarantined_run
from jobgen.runs.materialize import materialize, remove_new
from jobgen.runs.rundir import RunDir
from jobgen.runs.sweep_files import FLAT, FORMAT, LOGS_DIR, SWEEP_INDEX, SWEEP_SCRIPT, PointEntry, SweepIndex, SweepJob
from jobgen.runs.sweep_runs import SweepError, read_sweep
from jobgen.slurm import client as slurm
from jobgen.spec.tables.run import MAX_ARRAY as MAX_TASKS  # Slurm's default MaxArraySize is 1001: indices 1-1000
from jobgen.sweep.claim import closed_reason, locked
from jobgen.sweep.points import Sweep, SweepPoint, allocation, overrides_key
from jobgen.sweep.render import render_sweep


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


def read_index(directory: Path) -> SweepIndex | None:
    """sweep.json, or None where there is none (not submitted yet). One that cannot be read
    refuses the submission, naming it: the points it lists would be lost."""
    if not (directory / SWEEP_INDEX).is_file():
        return None
    try:
        return read_sweep(directory)
    except SweepError as exc:
        raise SubmitError([Finding("error", "", str(exc))]) from None


def point_entry(point: SweepPoint) -> PointEntry:
    """A point as sweep.json records it: what it is; where its files are is derived from the
    sweep's directory and its name (jobgen.runs.sweep_files), never recorded."""
    return PointEntry(point.name, point.overrides, point.spec.run.job.program, point.spec.run.job.array)


def _findings(sweep: Sweep, new: list[SweepPoint], *, ignore_memory_plan: bool) -> list[Finding]:
    """The memory plan and the program's checks of every new point, named by the point."""
    out = []
    for point in new:
        spec = point.spec
        for f in memory_findings(spec, ignore=ignore_memory_plan) + pass_env_findings(spec) + command_findings(spec):
            out.append(Finding(f.level, f.key, f"point {point.name}: {f.message}"))
    return out


def _busy(index: SweepIndex | None) -> list[slurm.QueueEntry]:
    ids = [job.job_id for job in index.jobs] if index is not None else []
    return slurm.queue(ids) if ids else []


def _open_tasks(index: SweepIndex) -> tuple[int, int, list[str]]:
    """Tasks the array needs (job.array for each open point), the open points, and the
    closed points' words."""
    tasks, open_points, closed = 0, 0, []
    for entry in index.points:
        # Counted afresh: a new array gives every point its tasks again (jobgen.sweep.claim
        # counts the claims of its own array only), and a failed point is retried.
        reason = closed_reason(index.run(entry), entry.attempts, used=0)
        if reason is None or reason == "failed":
            tasks += entry.attempts
            open_points += 1
        else:
            closed.append(f"{entry.name} ({reason})")
    return tasks, open_points, closed


def _match(sweep: Sweep, index: SweepIndex | None) -> tuple[list[PointEntry], list[SweepPoint], list[Finding]]:
    """The points the sweep has (sweep.json), the file's points it does not have yet, and the
    problems. A point is the same point when its overrides are: a name that changed because
    other points came (a shorter key no longer unique) keeps the point it names."""
    known = list(index.points) if index is not None else []
    by_overrides = {overrides_key(p.overrides) for p in known}
    names = {p.name for p in known}
    new = [p for p in sweep.points if overrides_key(p.overrides) not in by_overrides]
    findings = [
        Finding("error", "sweep", f"point {p.name}: the sweep already has a point of that name with other overrides")
        for p in new
        if p.name in names
    ]
    if new and index is not None and index.format == FLAT:
        findings.append(
            Finding(
                "error",
                "sweep",
                f"{index.directory} was submitted by an older jobgen, with its points beside {SWEEP_INDEX}: it "
                f"continues as it is, but takes no new point ({', '.join(p.name for p in new)}); give the new "
                "points a sweep of their own (another job.name)",
            )
        )
    return known, new, findings


def _kept_problems(sweep: Sweep, index: SweepIndex | None) -> list[Finding]:
    """Points the sweep has that the array's tasks cannot run: their allocation is not what the
    file's base asks for now (another node count, partition, time...), or their script names
    another directory (the sweep was moved or copied: each point's script was rendered for
    where it was, and a point that exists is never rendered again)."""
    wanted, out = allocation(sweep.base), []
    for entry in index.points if index is not None else []:
        run = index.run(entry)
        try:
            spec = run.load_spec()
        except (OSError, ValueError) as exc:
            out.append(Finding("error", "", f"point {entry.name}: cannot read its spec.json: {exc}"))
            continue
        if spec.run_dir.resolve() != run.path.resolve():
            out.append(
                Finding(
                    "error",
                    "job.runs_root",
                    f"point {entry.name} was submitted in {spec.run_dir}, and its script runs there: a sweep that "
                    "was moved or copied is read, stopped and compared where it is, not submitted again",
                )
            )
        have = allocation(spec)
        if have != wanted:
            diff = sorted(set(have) ^ set(wanted))
            out.append(
                Finding(
                    "error",
                    "job",
                    f"point {entry.name} was submitted asking Slurm for what the file no longer asks "
                    f"({', '.join(diff)}): one array asks the same of every task; start a new sweep (another "
                    "job.name) for the new allocation",
                )
            )
    return out


def _quarantined(point: Path) -> list[str]:
    """The nodes a point quarantined (jobgen.launch.submit._quarantined for a point's directory)."""
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
    planned = SweepIndex(
        sweep.directory,
        index.format if index is not None else FORMAT,
        sweep.name,
        sweep.settings.max_parallel,
        [*known, *(point_entry(p) for p in new)],
        list(index.jobs) if index is not None else [],
    )
    tasks, open_points, closed = _open_tasks(planned)
    quarantined = sorted({n for e in known for n in _quarantined(planned.point_dir(e.name))})
    options = _options(sweep, min(tasks, MAX_TASKS), open_points, quarantined, after)
    result = SweepSubmitResult(sweep.directory, sweep.directory / SWEEP_SCRIPT, new_points=[p.name for p in new])
    result.kept_points, result.tasks = [e.name for e in known], min(tasks, MAX_TASKS)
    result.command = ["sbatch", "--parsable", *options, str(result.script)]
    findings += _kept_problems(sweep, index) + _findings(sweep, new, ignore_memory_plan=ignore_memory_plan)
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
    result.job_id = _queue(sweep, new, planned, index, script, source_text, options)
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
    sweep: Sweep, index: SweepIndex | None, tasks: int, closed: list[str], after: int | None
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
    planned: SweepIndex,
    index: SweepIndex | None,
    script: str,
    source_text: str | None,
    options: list[str],
) -> int:
    """Write the new points, the index and the script, then sbatch, under the sweep's lock:
    a submission that finds the index changed since it looked (another one of the same sweep)
    is refused. When sbatch fails, the points this submission created are removed and the
    index is as it was."""
    (sweep.directory / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    index_path = sweep.directory / SWEEP_INDEX
    with locked(sweep.directory):
        if read_index(sweep.directory) != index:
            raise SubmitError([Finding("error", "", f"another submission changed {sweep.directory}: submit again")])
        before = index_path.read_bytes() if index is not None else None
        created: list[RunDir] = []
        cleared: list[tuple[RunDir, Path]] = []
        try:
            for point in new:
                run, _ = materialize(point.spec, render(point.spec), source_text, new_only=True)
                created.append(run)
            # The resubmission is the user's word that the failures are fixed (as for a run);
            # before sbatch: a task may claim at once.
            for entry in index.points if index is not None else []:  # the points the sweep had
                moved = clear_failure(planned.run(entry))
                if moved is not None:
                    cleared.append((planned.run(entry), moved))
            write_json_atomic(index_path, planned.to_json())
            script_path = sweep.directory / SWEEP_SCRIPT
            write_text_atomic(script_path, script, mode=0o777)
            job_id = slurm.sbatch(script_path, options)
        except BaseException:
            for run in created:
                remove_new(run)
            for run, moved in cleared:
                os.replace(moved, run.failed_marker)
            if before is not None:
                write_bytes_atomic(index_path, before)
            else:
                index_path.unlink(missing_ok=True)
            raise
        write_json_atomic(index_path, replace(planned, jobs=[*planned.jobs, SweepJob(job_id, options)]).to_json())
    return job_id
