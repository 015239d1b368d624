"""Submission: render, preflight, run directory, sbatch, in that order.

Nothing is created before the preflight passes, and a run directory created by a
submission that then fails is removed again. Resubmitting a run continues it in
the same directory (same checkpoints), but never while another job of that run is
still queued or running, unless it is chained behind it with ``--after``.

This module owns that order and ``--local``; the script comes from jobgen.launch.render, and
every name in the run directory (the script's, the batch log's) from jobgen.runs.rundir.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from jobgen.base import lease
from jobgen.base.safe_read import DamagedFile
from jobgen.launch.preflight import (
    Finding,
    command_findings,
    kill_window,
    memory_findings,
    pass_env_findings,
    preflight,
)
from jobgen.launch.render import render, script_name
from jobgen.launch.resume_check import resume_problem
from jobgen.runs import quarantine
from jobgen.runs.goodput import kill_window_warning, lead_time_warning, run_reports
from jobgen.runs.materialize import materialize, remove_new
from jobgen.runs.rundir import RunDir, RunDirTaken
from jobgen.slurm import client as slurm
from jobgen.spec.resolved import ResolvedSpec


class SubmitError(RuntimeError):
    """Submission refused; ``findings`` lists every reason."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("\n".join(str(f) for f in findings))


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
    Nodes the run has quarantined (jobgen.runs.quarantine) join the spec's ``--exclude`` here, on
    the command line, so the rendered script stays a function of the spec alone."""
    options = []
    if quarantined:
        exclude = [*spec.run.job.exclude, *(n for n in quarantined if n not in spec.run.job.exclude)]
        options.append("--exclude=" + ",".join(exclude))
    if spec.run.job.resumable:
        # %1: one task at a time; each continues from the previous task's checkpoint.
        options.append(f"--array=1-{array or spec.run.job.array}%1")
    if after is not None:
        options.append(f"--dependency=afterany:{after}")
    return options


def active_jobs(run: RunDir) -> list[slurm.QueueEntry]:
    """Jobs of this run that Slurm still has queued or running."""
    ids = [j["job_id"] for j in run.jobs() if not j.get("local")]
    return slurm.queue(ids) if ids else []


def _quarantined(spec: ResolvedSpec) -> list[str]:
    return quarantined_nodes(spec.run_dir) if spec.run_dir.is_dir() else []


def quarantined_nodes(run_dir: Path) -> list[str]:
    """The nodes the run quarantined, for --exclude. A file that cannot be read refuses the
    submission (one error line naming it): submitting without it could land on a node the
    run found broken."""
    try:
        return sorted(quarantine.read(RunDir(run_dir)))
    except quarantine.QuarantineError as exc:
        raise SubmitError([Finding("error", "", str(exc))]) from None
    except OSError as exc:
        raise SubmitError([Finding("error", "", f"cannot read {exc.filename}: {exc.strerror}")]) from None


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
    script = render(spec)
    name = script_name(spec)
    quarantined = _quarantined(spec)
    options = sbatch_options(spec, array=array, after=after, quarantined=quarantined)
    script_path = spec.run_dir / name
    result = SubmitResult(
        run_dir=spec.run_dir, script=script_path, command=["sbatch", "--parsable", *options, str(script_path)]
    )

    findings = _preflight_findings(
        spec, script, name, options, quarantined, skip_preflight=skip_preflight, ignore_memory_plan=ignore_memory_plan
    )
    run = RunDir(spec.run_dir)
    existed = run.exists()
    if existed:
        findings += _continue_findings(spec, run, after=after, skip_preflight=skip_preflight)
    result.findings = findings
    if any(f.level == "error" for f in findings):
        raise SubmitError(findings)
    if dry_run:
        return result

    # A run found absent skipped the busy checks above: one that appears meanwhile (another
    # submission of it) is refused, never continued as if it were idle.
    result.created, result.job_id = _queue(
        spec, script, source_text, options, new_only=not existed, array=array, after=after
    )
    return result


def _preflight_findings(
    spec: ResolvedSpec,
    script: str,
    name: str,
    options: list[str],
    quarantined: list[str],
    *,
    skip_preflight: bool,
    ignore_memory_plan: bool,
) -> list[Finding]:
    """The memory plan's findings, then the preflight's of ``script`` (written as ``name``
    to a temporary directory; nothing is written into the run directory yet), then a note of
    the quarantined nodes the submission excludes."""
    # The memory plan needs no cluster: a run predicted not to fit is refused even where
    # Slurm cannot be reached, before anything is written or queued.
    memory = memory_findings(spec, ignore=ignore_memory_plan) + pass_env_findings(spec) + command_findings(spec)
    memory += _resume_findings(spec)
    findings: list[Finding] = []
    if not skip_preflight:
        with tempfile.TemporaryDirectory(prefix="jobgen-preflight-") as tmp:
            candidate = Path(tmp) / name
            candidate.write_text(script)
            try:
                findings = preflight(spec, candidate, options, quarantined)
            except slurm.SlurmUnavailable:
                if any(f.level == "error" for f in memory):
                    raise SubmitError(memory) from None
                raise
    findings = memory + findings
    if quarantined:
        findings.append(
            Finding(
                "info",
                "",
                f"excluding the node(s) this run quarantined: {', '.join(quarantined)} "
                f"(jobgen status {spec.run.job.name}; jobgen doctor --clear {spec.run.job.name} releases them)",
            )
        )
    return findings


def _resume_findings(spec: ResolvedSpec) -> list[Finding]:
    """A run whose checkpoint the next task would refuse (another global batch): found now,
    without the cluster, rather than after the queue wait."""
    if not spec.run.job.kind.trains:
        return []
    problem = resume_problem(spec.run.train, spec.world_sizes, spec.run_dir)
    return [Finding("error", "train.global_batch_size", problem)] if problem else []


def _continue_findings(spec: ResolvedSpec, run: RunDir, *, after: int | None, skip_preflight: bool) -> list[Finding]:
    """What a submission that continues the existing ``run`` adds: warnings from its earlier
    tasks' reports, and, unless chained ``after`` a job, an error while it is still busy."""
    try:
        run.jobs()  # read before sbatch: a job queued that jobs.json cannot record would be lost
    except DamagedFile as exc:
        return [Finding("error", "", f"{exc}: the run's submissions cannot be recorded; repair or move it away")]
    findings: list[Finding] = []
    if spec.run.job.graceful_stop:  # else no save races a time limit or a SIGKILL
        reports = run_reports(run.path, spec.run.job.time)
        warning = lead_time_warning(spec.run.job.exit_grace, reports)
        if warning:
            findings.append(Finding("warning", "job.exit_grace", warning))
        if not skip_preflight:
            warning = kill_window_warning(kill_window(spec), reports)
            if warning:
                findings.append(Finding("warning", "train.async_save", warning))
    if after is None:
        findings.extend(_writer_busy(spec))
        busy = active_jobs(run)
        if busy:
            listing = ", ".join(f"{e.job_id} ({e.state})" for e in busy)
            findings.append(
                Finding(
                    "error",
                    "",
                    f"run {run.path} still has job(s) {listing}: chain with "
                    f"--after {busy[0].array_job_id}, or stop it first (jobgen stop {spec.run.job.name})",
                )
            )
    return findings


def _queue(
    spec: ResolvedSpec,
    script: str,
    source_text: str | None,
    options: list[str],
    *,
    new_only: bool,
    array: int | None,
    after: int | None,
) -> tuple[bool, int]:
    """Create or update the run directory, queue its script with sbatch and record the job.
    Returns whether the run directory was created, and the job id; a run directory created
    here is removed again when sbatch fails."""
    run, created = _materialize(spec, script, source_text, new_only=new_only)
    cleared = clear_failure(run)
    try:
        job_id = slurm.sbatch(run.script(spec.run.job.program), options)
    except BaseException:
        if created:
            remove_new(run)
        elif cleared is not None:  # not queued: the failure still stands
            os.replace(cleared, run.failed_marker)
        raise
    tasks = (array or spec.run.job.array) if spec.run.job.resumable else None
    run.record_job({"job_id": job_id, "options": options, "array": tasks, "after": after})
    return created, job_id


def _materialize(spec: ResolvedSpec, script: str, source_text: str | None, *, new_only: bool) -> tuple[RunDir, bool]:
    """:func:`jobgen.runs.materialize.materialize`; losing the race to create the run directory is
    refused as a busy run is, with a sentence (exit status 2), not an OSError."""
    try:
        return materialize(spec, script, source_text, new_only=new_only)
    except RunDirTaken as exc:
        raise SubmitError([Finding("error", "", str(exc))]) from None


def _writer_busy(spec: ResolvedSpec) -> list[Finding]:
    """An error when a process holds the run's writer lease (jobgen.base.lease): a second writer
    would delete the first one's checkpoints."""
    writer = lease.holder(RunDir(spec.run_dir).writer_lease)
    if not writer:
        return []
    return [
        Finding(
            "error",
            "",
            f"run {spec.run_dir} is being written by {writer}: wait for it to end, "
            f"or stop it first (jobgen stop {spec.run.job.name})",
        )
    ]


def clear_failure(run: RunDir) -> Path | None:
    """A resubmission is the user's word that the failure which stopped the run is fixed:
    the ``failed`` marker moves into history/, where it stays on record. Returns where it
    went (None: there was none), so that a submission that fails can put it back."""
    if not run.failed_marker.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S")
    moved = run.path / "history" / f"failed-{stamp}.json"
    os.replace(run.failed_marker, moved)
    return moved


def local_environment(spec: ResolvedSpec, job_id: int) -> dict[str, str]:
    """The SLURM_* variables a one-node allocation would give the batch script."""
    host = socket.gethostname().split(".")[0]
    cpus = str(spec.site.slurm.cpus_per_node)
    return {
        **os.environ,
        "JOBGEN_LOCAL": "1",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NAME": spec.run.job.name,
        "SLURM_JOB_NODELIST": host,
        "SLURM_NODELIST": host,
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_CPUS_PER_TASK": cpus,
        "SLURM_JOB_CPUS_PER_NODE": cpus,
        "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_SUBMIT_DIR": os.getcwd(),
        "SLURMD_NODENAME": host,
    }


def run_local(
    spec: ResolvedSpec, *, source_text: str | None = None, ignore_memory_plan: bool = False
) -> tuple[RunDir, int]:
    """Run the rendered script on this machine as a one-node job, without Slurm."""
    problems = [f for f in memory_findings(spec, ignore=ignore_memory_plan) if f.level == "error"]
    problems += pass_env_findings(spec)
    if spec.run.job.nodes != 1:
        problems.append(
            Finding(
                "error", "job.nodes", f"--local runs on this one machine; the spec asks for {spec.run.job.nodes} nodes"
            )
        )
    if spec.site.python.kind == "container":
        problems.append(
            Finding("error", "site.python.kind", "--local cannot start pyxis containers; use a venv or modules site")
        )
    existed = RunDir(spec.run_dir).exists()
    problems.extend(_writer_busy(spec))
    if problems:
        raise SubmitError(problems)
    run, _ = _materialize(spec, render(spec), source_text, new_only=not existed)
    clear_failure(run)
    job_id = int(time.time())
    run.record_job({"job_id": job_id, "local": True, "options": []})
    log_path = run.batch_log(spec.run.job.name, job_id)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            ["bash", str(run.script(spec.run.job.program))],
            env=local_environment(spec, job_id),
            cwd=run.path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert proc.stdout is not None
        for chunk in iter(lambda: proc.stdout.readline(), b""):
            log.write(chunk)
            log.flush()
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        rc = proc.wait()
    return run, rc
