"""Submitting a run: what the submission core (jobgen.launch.submission) is told of a run.

Nothing is created before the preflight passes, and a run directory created by a submission
that then fails is removed again; a continued run's spec, run.toml and script are put back.
Resubmitting a run continues it in the same directory (same checkpoints), but never while
another job of that run is still queued or running, unless it is chained behind it with
``--after``. ``--local`` is the same submission run by the local executor
(jobgen.launch.executors): the same script on this machine, without Slurm.

The script comes from jobgen.launch.render, and every name in the run directory (the script's,
the batch log's) from jobgen.runs.rundir.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from jobgen.base import lease
from jobgen.base.safe_read import DamagedFile
from jobgen.launch import submission as core
from jobgen.launch.container_step import mounted_directories_made
from jobgen.launch.environment import environment_findings
from jobgen.launch.executors import Executor, LocalExecutor, LocalJob, SlurmExecutor
from jobgen.launch.executors import local_environment as job_environment
from jobgen.launch.preflight import Finding, command_findings, memory_findings, pass_env_findings
from jobgen.launch.render import render as render_run
from jobgen.launch.render import script_name
from jobgen.launch.resume_check import resume_problem
from jobgen.launch.submission import Job, Rollback, SubmitError, quarantined_nodes
from jobgen.runs.goodput import kill_window_warning, lead_time_warning, run_reports
from jobgen.runs.materialize import materialize
from jobgen.runs.rundir import RunDir, RunDirTaken
from jobgen.spec.resolved import ResolvedSpec


@dataclass
class SubmitResult:
    run_dir: Path
    script: Path
    command: list[str]
    job_id: int | None = None
    created: bool = False
    findings: list[Finding] = field(default_factory=list)


def sbatch_options(
    spec: ResolvedSpec, *, array: int | None = None, after: int | None = None, quarantined: list[str] = ()
) -> list[str]:
    """Options given on the sbatch command line (the script's #SBATCH lines carry the rest).
    Nodes the run has quarantined (jobgen.runs.quarantine) join the spec's ``--exclude``."""
    options = core.exclude_option(spec.run.job.exclude, list(quarantined))
    if spec.run.job.resumable:
        # %1: one task at a time; each continues from the previous task's checkpoint.
        options.append(f"--array=1-{array or spec.run.job.array}%1")
    return options + core.dependency_option(after)


class RunSubmission(core.Submission):
    """A run: its checks, its run directory created or continued, jobs.json."""

    def __init__(
        self,
        spec: ResolvedSpec,
        *,
        source_text: str | None,
        array: int | None = None,
        after: int | None = None,
        ignore_memory_plan: bool = False,
    ):
        self.spec, self.source_text, self.array, self.after = spec, source_text, array, after
        self.ignore_memory_plan = ignore_memory_plan
        self.script_name = script_name(spec)
        self.preflight_spec = spec
        self.run = RunDir(spec.run_dir)
        self.existed = self.run.exists()
        self.created = False

    def render(self) -> str:
        return render_run(self.spec)

    def read_quarantine(self) -> list[str]:
        return quarantined_nodes(self.spec.run_dir)

    def options(self) -> list[str]:
        return sbatch_options(self.spec, array=self.array, after=self.after, quarantined=self.quarantined)

    def checks(self) -> list[Finding]:
        """The memory plan, the environment to pass, the program's words, the checkpoint: none
        needs the cluster, so a run predicted not to fit is refused even where Slurm cannot be
        reached, before anything is written or queued."""
        spec = self.spec
        found = memory_findings(spec, ignore=self.ignore_memory_plan) + pass_env_findings(spec)
        return found + command_findings(spec) + environment_findings(spec) + _resume_findings(spec)

    def cluster_checks(self, executor: Executor, *, skip_preflight: bool) -> list[Finding]:
        """The nodes excluded, then what continuing the run adds."""
        found = []
        if self.quarantined:
            name = self.spec.run.job.name
            found.append(
                Finding(
                    "info",
                    "",
                    f"excluding the node(s) this run quarantined: {', '.join(self.quarantined)} "
                    f"(jobgen status {name}; jobgen doctor --clear {name} releases them)",
                )
            )
        return found + self._continue_findings(executor, skip_preflight=skip_preflight)

    def local_checks(self, executor: Executor) -> list[Finding]:
        return self._continue_findings(executor, skip_preflight=True)

    def _continue_findings(self, executor: Executor, *, skip_preflight: bool) -> list[Finding]:
        """What continuing an existing run adds: warnings from its earlier tasks' reports where
        a time limit stops its job, and, unless chained ``after`` a job, an error while it is
        still busy (a process writes it, or a job of it is still queued or running)."""
        spec, run = self.spec, self.run
        if not self.existed:
            return []
        try:
            run.jobs()  # read before sbatch: a job queued that jobs.json cannot record would be lost
        except DamagedFile as exc:
            return [Finding("error", "", f"{exc}: the run's submissions cannot be recorded; repair or move it away")]
        findings: list[Finding] = []
        if spec.run.job.graceful_stop and executor.time_limited:  # else no save races a time limit or a SIGKILL
            reports = run_reports(run.path, spec.run.job.time)
            warning = lead_time_warning(spec.run.job.exit_grace, reports)
            if warning:
                findings.append(Finding("warning", "job.exit_grace", warning))
            if not skip_preflight:
                warning = kill_window_warning(executor.kill_window(spec), reports)
                if warning:
                    findings.append(Finding("warning", "train.async_save", warning))
        if self.after is None:
            findings.extend(_busy(spec, run, executor))
        return findings

    def materialise(self, undo: Rollback) -> Path:
        """Create or update the run directory (a run found absent skipped the busy checks: one
        that appears meanwhile is refused, never continued as if it were idle)."""
        run = self.run
        if self.existed:
            undo.replacing(run.spec_file, run.path / "run.toml", run.script(self.spec.run.job.program))
            undo.adding_to(run.path / "history")
        try:
            run, self.created = materialize(self.spec, self.script, self.source_text, new_only=not self.existed)
        except RunDirTaken as exc:  # refused as a busy run is, with a sentence (exit status 2)
            raise SubmitError([Finding("error", "", str(exc))]) from None
        if self.created:
            undo.created(run)
        core.clear_failure(run, undo)
        problem = mounted_directories_made(self.spec)
        if problem:
            raise SubmitError([Finding("error", problem[0], problem[1])])
        return run.script(self.spec.run.job.program)

    def record(self, job: Job) -> None:
        if job.local:
            self.run.record_job({"job_id": job.job_id, "local": True, "options": []})
            return
        tasks = (self.array or self.spec.run.job.array) if self.spec.run.job.resumable else None
        self.run.record_job({"job_id": job.job_id, "options": job.options, "array": tasks, "after": self.after})


def submit(
    spec: ResolvedSpec,
    *,
    source_text: str | None = None,
    array: int | None = None,
    after: int | None = None,
    dry_run: bool = False,
    skip_preflight: bool = False,
    ignore_memory_plan: bool = False,
) -> SubmitResult:
    """Render the script, check it and the run, then create or update the run directory and
    queue the script; ``dry_run`` stops after the checks. Raises SubmitError with every
    finding when one of them is an error."""
    run = RunSubmission(spec, source_text=source_text, array=array, after=after, ignore_memory_plan=ignore_memory_plan)
    done = core.submit(run, SlurmExecutor(), dry_run=dry_run, skip_preflight=skip_preflight)
    script = spec.run_dir / run.script_name
    return SubmitResult(
        run_dir=spec.run_dir,
        script=script,
        command=SlurmExecutor.command(run, script),
        job_id=done.job_id,
        created=run.created,
        findings=done.findings,
    )


def local_job(spec: ResolvedSpec) -> LocalJob:
    """The run as a one-node job on this machine: the first of its array's tasks."""
    run = RunDir(spec.run_dir)
    return LocalJob(
        name=spec.run.job.name,
        nodes=spec.run.job.allocated_nodes,
        cpus=spec.site.slurm.cpus_per_node,
        container=spec.site.python.kind == "container",
        without_container="use a venv or modules site",
        log=lambda job_id: run.batch_log(spec.run.job.name, job_id),
        environment={"SLURM_ARRAY_TASK_ID": "1"},
    )


def local_environment(spec: ResolvedSpec, job_id: int) -> dict[str, str]:
    """The SLURM_* variables a one-node allocation would give the run's batch script."""
    return job_environment(local_job(spec), job_id)


def run_local(
    spec: ResolvedSpec,
    *,
    source_text: str | None = None,
    ignore_memory_plan: bool = False,
    announce: Callable[[list[Finding]], None] | None = None,
) -> tuple[RunDir, int]:
    """Run the rendered script on this machine as a one-node job, without Slurm, after the
    same checks as a submission (``announce`` is shown those that are no errors first)."""
    run = RunSubmission(spec, source_text=source_text, ignore_memory_plan=ignore_memory_plan)
    done = core.submit(run, LocalExecutor(local_job(spec)), announce=announce or (lambda _findings: None))
    assert done.exit_status is not None  # a local job runs in the foreground
    return run.run, done.exit_status


def _resume_findings(spec: ResolvedSpec) -> list[Finding]:
    """A run whose checkpoint the next task would refuse (another global batch): found now,
    without the cluster, rather than after the queue wait."""
    if not spec.run.job.kind.trains:
        return []
    problem = resume_problem(spec.run.train, spec.world_sizes, spec.run_dir)
    return [Finding("error", "train.global_batch_size", problem)] if problem else []


def _queued_ids(run: RunDir) -> list[int]:
    return [j["job_id"] for j in run.jobs() if not j.get("local")]


def _busy(spec: ResolvedSpec, run: RunDir, executor: Executor) -> list[Finding]:
    """Errors while the run is busy: a process holds its writer lease (jobgen.base.lease: a
    second writer would delete the first one's checkpoints), or a job of it is still queued or
    running."""
    found, name = [], spec.run.job.name
    writer = lease.holder(run.writer_lease)
    if writer:
        message = f"run {spec.run_dir} is being written by {writer}: wait for it to end, or stop it first"
        found.append(Finding("error", "", f"{message} (jobgen stop {name})"))
    busy = executor.still_queued(_queued_ids(run))
    if busy:
        listing = ", ".join(f"{e.job_id} ({e.state})" for e in busy)
        message = f"run {run.path} still has job(s) {listing}: chain with --after {busy[0].array_job_id}"
        found.append(Finding("error", "", f"{message}, or stop it first (jobgen stop {name})"))
    return found
