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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from jobgen.base.atomic import write_json_atomic, write_text_atomic
from jobgen.launch import submission as core
from jobgen.launch.executors import Executor, SlurmExecutor
from jobgen.launch.preflight import Finding, command_findings, memory_findings, pass_env_findings
from jobgen.launch.render import render
from jobgen.launch.submission import Job, Rollback, SubmitError
from jobgen.runs.materialize import materialize
from jobgen.runs.sweep_files import FLAT, FORMAT, LOGS_DIR, SWEEP_INDEX, SWEEP_SCRIPT, PointEntry, SweepIndex, SweepJob
from jobgen.runs.sweep_runs import SweepError, read_sweep
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


class SweepSubmission(core.Submission):
    """A sweep: its new points' run directories, sweep.json and its one array."""

    def __init__(self, sweep: Sweep, *, source_text: str | None, after: int | None, ignore_memory_plan: bool):
        self.sweep, self.source_text, self.after = sweep, source_text, after
        self.ignore_memory_plan = ignore_memory_plan
        self.script_name = SWEEP_SCRIPT
        self.preflight_spec = sweep.base
        self.index = read_index(sweep.directory)
        self.known, self.new, self.match_findings = _match(sweep, self.index)
        self.planned = SweepIndex(
            sweep.directory,
            self.index.format if self.index is not None else FORMAT,
            sweep.name,
            sweep.settings.max_parallel,
            [*self.known, *(point_entry(p) for p in self.new)],
            list(self.index.jobs) if self.index is not None else [],
        )
        self.tasks, self.open_points, self.closed = _open_tasks(self.planned)

    def render(self) -> str:
        return render_sweep(self.sweep)

    def read_quarantine(self) -> list[str]:
        """The nodes the sweep's points quarantined (as a run's resubmission does)."""
        points = (core.quarantined_nodes(self.planned.point_dir(e.name)) for e in self.known)
        return sorted({node for nodes in points for node in nodes})

    def options(self) -> list[str]:
        """The array (at most K at once, and no more than the points open: a task beyond them
        would only wait for one), the quarantined nodes, the dependency."""
        tasks, parallel = (
            max(min(self.tasks, MAX_TASKS), 1),
            max(1, min(self.sweep.settings.max_parallel, self.open_points)),
        )
        exclude = core.exclude_option(self.sweep.base.run.job.exclude, self.quarantined)
        return [f"--array=1-{tasks}%{parallel}", *exclude, *core.dependency_option(self.after)]

    def checks(self) -> list[Finding]:
        """The points against sweep.json and the file, every new point's checks, the sweep's."""
        findings = self.match_findings + _kept_problems(self.sweep, self.index)
        findings += _point_findings(self.new, ignore_memory_plan=self.ignore_memory_plan)
        return findings + _sweep_findings(self.sweep, self.tasks, self.closed)

    def cluster_checks(self, executor: Executor, *, skip_preflight: bool) -> list[Finding]:
        """An error while the sweep's array is still queued, unless chained after a job."""
        if self.after is not None or self.index is None:
            return []
        busy = executor.still_queued([job.job_id for job in self.index.jobs])
        if not busy:
            return []
        job = busy[0]
        return [
            Finding(
                "error",
                "",
                f"sweep {self.sweep.directory} still has job {job.array_job_id} ({job.state}): chain with "
                f"--after {job.array_job_id}, or stop it first (jobgen stop {self.sweep.name})",
            )
        ]

    @contextmanager
    def guard(self) -> Iterator[None]:
        """The sweep's lock: a submission that finds the index changed since it looked
        (another one of the same sweep) is refused."""
        (self.sweep.directory / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        with locked(self.sweep.directory):
            if read_index(self.sweep.directory) != self.index:
                raise SubmitError(
                    [Finding("error", "", f"another submission changed {self.sweep.directory}: submit again")]
                )
            yield

    def materialise(self, undo: Rollback) -> Path:
        """The new points, the failures of the points it had cleared (the resubmission is the
        user's word that they are fixed, as for a run; before sbatch: a task may claim at once),
        the index and the script."""
        directory = self.sweep.directory
        undo.replacing(directory / SWEEP_INDEX, directory / SWEEP_SCRIPT)
        for point in self.new:
            run, _ = materialize(point.spec, render(point.spec), self.source_text, new_only=True)
            undo.created(run)
        for entry in self.index.points if self.index is not None else []:  # the points the sweep had
            core.clear_failure(self.planned.run(entry), undo)
        write_json_atomic(directory / SWEEP_INDEX, self.planned.to_json())
        write_text_atomic(directory / SWEEP_SCRIPT, self.script, mode=0o777)
        return directory / SWEEP_SCRIPT

    def record(self, job: Job) -> None:
        jobs = [*self.planned.jobs, SweepJob(job.job_id, job.options)]
        write_json_atomic(self.sweep.directory / SWEEP_INDEX, replace(self.planned, jobs=jobs).to_json())


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
    SubmitError with every finding when one is an error; nothing is written then. When sbatch
    fails, the points this submission created are removed and the index is as it was."""
    sub = SweepSubmission(sweep, source_text=source_text, after=after, ignore_memory_plan=ignore_memory_plan)
    done = core.submit(sub, SlurmExecutor(), dry_run=dry_run, skip_preflight=skip_preflight)
    result = SweepSubmitResult(sweep.directory, sweep.directory / SWEEP_SCRIPT, new_points=[p.name for p in sub.new])
    result.kept_points, result.tasks = [e.name for e in sub.known], min(sub.tasks, MAX_TASKS)
    result.command = SlurmExecutor.command(sub, result.script)
    result.findings, result.job_id = done.findings, done.job_id
    return result


def _point_findings(new: list[SweepPoint], *, ignore_memory_plan: bool) -> list[Finding]:
    """The memory plan and the program's checks of every new point, named by the point."""
    out = []
    for point in new:
        spec = point.spec
        for f in memory_findings(spec, ignore=ignore_memory_plan) + pass_env_findings(spec) + command_findings(spec):
            out.append(Finding(f.level, f.key, f"point {point.name}: {f.message}"))
    return out


def _sweep_findings(sweep: Sweep, tasks: int, closed: list[str]) -> list[Finding]:
    """What the sweep as a whole says: points left alone, nothing to run, too many tasks, a
    single run's directory in the way."""
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
    return out
