"""Where a submitted job runs: queued on Slurm (:class:`SlurmExecutor`), or its same batch
script run on this machine as a one-node job without Slurm (:class:`LocalExecutor`,
``jobgen submit --local`` and ``jobgen serve --local``).

The submission core (jobgen.launch.submission) drives either one the same way: its checks
(Slurm's preflight against the live cluster, in a temporary directory; this machine's limits),
starting the job, and following it (a queued job is left to Slurm; a local one is run in the
foreground until it ends). What a submission checks beyond that is asked of it by the executor
(``cluster_checks`` or ``local_checks``), so neither the submission nor the core asks which
executor it has.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from jobgen.launch.preflight import Finding, kill_window, preflight
from jobgen.launch.submission import Executor, Job, Submission, SubmitError, errors
from jobgen.runs.goodput import KillWindow
from jobgen.slurm import client as slurm
from jobgen.spec.resolved import ResolvedSpec


class SlurmExecutor(Executor):
    """sbatch: the preflight against the live cluster, then the job queued."""

    def checks(self, submission: Submission, found: list[Finding], *, skip_preflight: bool) -> list[Finding]:
        submission.options()  # the quarantined nodes read now: an unreadable record refuses before anything
        findings = [] if skip_preflight else self._preflight(submission, found)
        return findings + submission.cluster_checks(self, skip_preflight=skip_preflight)

    @staticmethod
    def _preflight(submission: Submission, found: list[Finding]) -> list[Finding]:
        """jobgen.launch.preflight on the script written as its name to a temporary directory
        (nothing is written where the job runs yet). Slurm out of reach: the refusal the checks
        already found, else SlurmUnavailable."""
        if submission.preflight_spec is None:
            return []
        with tempfile.TemporaryDirectory(prefix="jobgen-preflight-") as tmp:
            candidate = Path(tmp) / submission.script_name
            candidate.write_text(submission.script)
            try:
                return preflight(submission.preflight_spec, candidate, submission.options(), submission.quarantined)
            except slurm.SlurmUnavailable:
                if errors(found):
                    raise SubmitError(found) from None
                raise

    @staticmethod
    def command(submission: Submission, script: Path) -> list[str]:
        """What queues the submission's script (what a dry run shows)."""
        return ["sbatch", "--parsable", *submission.options(), str(script)]

    def still_queued(self, job_ids: list[int]) -> list[slurm.QueueEntry]:
        return slurm.queue(job_ids) if job_ids else []

    def kill_window(self, spec: ResolvedSpec) -> KillWindow | None:
        return kill_window(spec)

    def start(self, submission: Submission, script: Path) -> Job:
        options = submission.options()
        return Job(slurm.sbatch(script, options), options)

    def abandon(self, job: Job) -> None:
        """A queued job stays queued: Slurm has it (its record was found writable before)."""
        return None


@dataclass(frozen=True)
class LocalJob:
    """What running a batch script on this machine needs to know of its job."""

    name: str  # Slurm's job name (SLURM_JOB_NAME)
    nodes: int  # nodes the spec asks for, spares included: --local has this one
    cpus: int  # the CPUs the allocation would have (SLURM_CPUS_PER_TASK)
    container: bool  # a pyxis container: --local cannot start one
    without_container: str  # what to do instead, in the refusal
    log: Callable[[int], Path]  # where the script's output goes, by job id
    environment: dict[str, str] = field(default_factory=dict)  # more of Slurm's variables
    time_limit: int | None = None  # seconds, then SIGTERM as Slurm's time limit would


def local_environment(job: LocalJob, job_id: int) -> dict[str, str]:
    """The SLURM_* variables a one-node allocation would give the batch script."""
    host = socket.gethostname().split(".")[0]
    return {
        **os.environ,
        "JOBGEN_LOCAL": "1",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NAME": job.name,
        "SLURM_JOB_NODELIST": host,
        "SLURM_NODELIST": host,
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_CPUS_PER_TASK": str(job.cpus),
        "SLURM_JOB_CPUS_PER_NODE": str(job.cpus),
        **job.environment,
        "SLURM_SUBMIT_DIR": os.getcwd(),
        "SLURMD_NODENAME": host,
    }


def echo_bytes(chunk: bytes) -> None:
    sys.stdout.buffer.write(chunk)
    sys.stdout.flush()


class LocalExecutor(Executor):
    """The batch script on this machine, in the foreground, as a one-node job: until it ends,
    its time limit, Ctrl-C or a SIGTERM to this process. The time limit and a SIGTERM reach the
    script as Slurm's SIGTERM would (it stops its program as planned); Ctrl-C reaches the whole
    job from the terminal, and the script gets a SIGTERM too. Either way this waits for the
    script to exit, logging it to the end: no job is left running behind a jobgen that has
    gone."""

    # Its time limit (if any) is a SIGTERM, after which the script gets all the time it takes:
    # no save races a kill here.
    time_limited = False

    def __init__(self, job: LocalJob, echo: Callable[[bytes], None] = echo_bytes):
        self.job = job
        self.echo = echo

    def checks(self, submission: Submission, found: list[Finding], *, skip_preflight: bool) -> list[Finding]:
        findings = []
        if self.job.nodes != 1:
            findings.append(
                Finding(
                    "error", "job.nodes", f"--local runs on this one machine; the spec asks for {self.job.nodes} nodes"
                )
            )
        if self.job.container:
            refusal = f"--local runs no container (its steps are started by srun); {self.job.without_container}"
            findings.append(Finding("error", "site.python.kind", refusal))
        return findings + submission.local_checks(self)

    def start(self, submission: Submission, script: Path) -> Job:
        job_id = int(time.time())
        process = subprocess.Popen(
            ["bash", str(script)],
            env=local_environment(self.job, job_id),
            cwd=script.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        return Job(job_id, [], process)

    def abandon(self, job: Job) -> None:
        if job.process is not None and job.process.poll() is None:
            job.process.send_signal(signal.SIGTERM)
            job.process.wait()

    def follow(self, job: Job) -> int | None:
        proc = job.process
        assert proc is not None and proc.stdout is not None  # started by start() above

        def terminate(*_args: object) -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

        limit = threading.Timer(self.job.time_limit, terminate) if self.job.time_limit is not None else None
        # A SIGTERM to jobgen is passed on, as Slurm's reaches a batch script (only the main
        # thread may set a handler; a caller on another one stops the job itself).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, terminate) if main else None
        if limit is not None:
            limit.daemon = True
            limit.start()
        try:
            with self.job.log(job.job_id).open("ab") as log:
                self._copy(proc, log, terminate)
            return proc.wait()
        finally:
            if limit is not None:
                limit.cancel()
            if main:
                signal.signal(signal.SIGTERM, previous)
            terminate()
            proc.wait()

    def _copy(self, proc: subprocess.Popen[bytes], log, terminate: Callable[[], None]) -> None:
        """The script's output, line by line, to its log and to ``echo``, until it closes."""
        assert proc.stdout is not None
        while True:
            try:
                chunk = proc.stdout.readline()
            except KeyboardInterrupt:  # Ctrl-C reached the script too; wait for it to stop
                terminate()
                continue
            if not chunk:
                return
            log.write(chunk)
            log.flush()
            self.echo(chunk)
