"""The submission core: checks, then the check against where the job runs, then the files
written, then the job queued (or started), rolled back when it fails; one sequence for a run,
a sweep and a served model.

Each caller hands :func:`submit` a :class:`Submission`, saying only what differs: what it
checks, its batch script and sbatch options, what it writes (registering with a
:class:`Rollback` what to undo) and how it records the job. An executor
(jobgen.launch.executors) says where the job runs: queued on Slurm, or ``--local`` on this
machine without Slurm; each runs its own checks (the preflight against the live cluster, or
this machine's limits) and asks the submission for the checks that concern it.

Nothing is written before every check passed, and a submission that fails before its job is
queued leaves things as they were: a directory it created is removed, a file it replaced is put
back, a failed marker it cleared is restored (:class:`Rollback`).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from subprocess import Popen

from jobgen.base.atomic import write_bytes_atomic
from jobgen.base.safe_read import DamagedFile, read_bytes
from jobgen.launch.preflight import Finding
from jobgen.runs import quarantine
from jobgen.runs.goodput import KillWindow
from jobgen.runs.materialize import remove_new
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm
from jobgen.spec.resolved import ResolvedSpec

# What a file put back may hold: larger than any run.toml, spec.json, script or sweep.json.
RESTORABLE_BYTES = 64 << 20


class SubmitError(RuntimeError):
    """Submission refused; ``findings`` lists every reason."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("\n".join(str(f) for f in findings))


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


@dataclass(frozen=True)
class Job:
    """A job this submission queued or started: its id, the options it was queued with, and
    for one run here (``--local``) the process running its batch script."""

    job_id: int
    options: list[str] = field(default_factory=list)
    process: Popen[bytes] | None = None

    @property
    def local(self) -> bool:
        return self.process is not None


@dataclass
class Submitted:
    """What :func:`submit` did: every finding of its checks, the job (None after a dry run),
    and the exit status of a job that ran here in the foreground (None for a queued one)."""

    findings: list[Finding]
    job: Job | None = None
    exit_status: int | None = None

    @property
    def job_id(self) -> int | None:
        return self.job.job_id if self.job is not None else None


class Submission(ABC):
    """What differs between submitting a run, a sweep and a served model."""

    # The batch script's file name, as the preflight writes it to a temporary directory.
    script_name: str
    # The spec the preflight checks against the live cluster; None: no preflight (a served
    # model's job asks the site profile's partition for one node, checked by jobgen.serve.render).
    preflight_spec: ResolvedSpec | None = None

    @abstractmethod
    def render(self) -> str:
        """The batch script's text (jobgen.launch.render, jobgen.sweep.render...)."""

    def read_quarantine(self) -> list[str]:
        """The nodes its runs quarantined (:func:`quarantined_nodes`)."""
        return []

    @cached_property
    def script(self) -> str:
        """The batch script, rendered once: the preflight checks what is written."""
        return self.render()

    @cached_property
    def quarantined(self) -> list[str]:
        """The nodes that join --exclude, read once: the preflight checks what is queued."""
        return self.read_quarantine()

    @abstractmethod
    def options(self) -> list[str]:
        """sbatch's command-line options (the script's #SBATCH lines carry the rest)."""

    def checks(self) -> list[Finding]:
        """What is checked first, wherever the job runs: the spec, the files, the memory plan."""
        return []

    def cluster_checks(self, executor: Executor, *, skip_preflight: bool) -> list[Finding]:
        """What is checked after the preflight when the job is queued on Slurm (``executor``)."""
        return []

    def local_checks(self, executor: Executor) -> list[Finding]:
        """What is checked when the job runs on this machine (``--local``, ``executor``)."""
        return []

    def guard(self) -> AbstractContextManager[object]:
        """Held while the files are written, the job queued and recorded (a sweep's lock)."""
        return nullcontext()

    @abstractmethod
    def materialise(self, undo: Rollback) -> Path:
        """Write what the job needs, telling ``undo`` how to take it back; the script to queue."""

    @abstractmethod
    def record(self, job: Job) -> None:
        """Record the job where the commands that read it look (jobs.json, sweep.json...)."""


class Executor(ABC):
    """Where a submission's job runs, and what can be asked of it there."""

    # Whether a time limit ends its jobs with a kill after a signal (Slurm's lead-time signal,
    # then SIGTERM and SIGKILL), so that job.exit_grace must cover a save.
    time_limited: bool = True

    @abstractmethod
    def checks(self, submission: Submission, found: list[Finding], *, skip_preflight: bool) -> list[Finding]:
        """The checks of where the job runs, then the submission's own for it. ``found``: what
        the submission's first checks found."""

    def still_queued(self, job_ids: list[int]) -> list[slurm.QueueEntry]:
        """Which of these jobs are still queued or running."""
        return []

    def kill_window(self, spec: ResolvedSpec) -> KillWindow | None:
        """How long a job gets from SIGTERM to SIGKILL, where it is known."""
        return None

    @abstractmethod
    def start(self, submission: Submission, script: Path) -> Job:
        """Queue or start ``script``."""

    def follow(self, job: Job) -> int | None:
        """Wait for a job that runs in the foreground; its exit status (None: it was queued)."""
        return None

    @abstractmethod
    def abandon(self, job: Job) -> None:
        """Stop a started job whose record could not be written."""


def submit(
    submission: Submission,
    executor: Executor,
    *,
    dry_run: bool = False,
    skip_preflight: bool = False,
    announce: Callable[[list[Finding]], None] | None = None,
) -> Submitted:
    """Check, then write, then queue or start, then record. Raises SubmitError with every
    finding when one is an error; nothing is written then, nor after ``dry_run``. With
    ``announce`` (a job that then runs in the foreground), the findings that are no errors are
    shown to it as soon as the checks are done, and a refusal lists the errors only."""
    findings = submission.checks()
    findings += executor.checks(submission, findings, skip_preflight=skip_preflight)
    if announce is not None:
        announce([f for f in findings if f.level != "error"])
        if errors(findings):
            raise SubmitError(errors(findings))
    if errors(findings):
        raise SubmitError(findings)
    if dry_run:
        return Submitted(findings)
    with submission.guard():
        with rolled_back_on_failure() as undo:
            script = submission.materialise(undo)
            job = executor.start(submission, script)
        try:
            submission.record(job)
        except BaseException:
            executor.abandon(job)
            raise
    return Submitted(findings, job, executor.follow(job))


def quarantined_nodes(run_dir: Path) -> list[str]:
    """The nodes the run in ``run_dir`` quarantined, for --exclude (none where there is no
    directory yet). A file that cannot be read refuses the submission (one error line naming
    it): submitting without it could land on a node the run found broken."""
    if not run_dir.is_dir():
        return []
    try:
        return sorted(quarantine.read(RunDir(run_dir)))
    except quarantine.QuarantineError as exc:
        raise SubmitError([Finding("error", "", str(exc))]) from None
    except OSError as exc:
        raise SubmitError([Finding("error", "", f"cannot read {exc.filename}: {exc.strerror}")]) from None


def exclude_option(exclude: list[str], quarantined: list[str]) -> list[str]:
    """``--exclude`` with the spec's nodes and then the quarantined ones, on the command line so
    that the rendered script stays a function of the spec alone; nothing without quarantine."""
    if not quarantined:
        return []
    return ["--exclude=" + ",".join([*exclude, *(n for n in quarantined if n not in exclude)])]


def dependency_option(after: int | None) -> list[str]:
    """``--after JOB``: queued behind that job, whatever way it ends."""
    return [] if after is None else [f"--dependency=afterany:{after}"]


def clear_failure(run: RunDir, undo: Rollback) -> None:
    """A resubmission is the user's word that the failure which stopped the run is fixed:
    the ``failed`` marker moves into history/, where it stays on record; put back when the
    submission fails (not queued: the failure still stands)."""
    if not run.failed_marker.exists():
        return
    moved = run.path / "history" / f"failed-{time.strftime('%Y%m%dT%H%M%S')}.json"
    os.replace(run.failed_marker, moved)
    undo.moved(moved, run.failed_marker)


class Rollback:
    """What a submission changed, taken back in reverse order when it fails before its job is
    queued: a submission that was not queued leaves things as they were."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], None]]] = []

    def created(self, run: RunDir) -> None:
        """A directory this submission created: removed."""
        self._steps.append((f"remove {run.path}", lambda: remove_new(run)))

    def moved(self, moved: Path, back_to: Path) -> None:
        """A file this submission moved away (a cleared failed marker): moved back."""
        self._steps.append((f"put back {back_to}", lambda: os.replace(moved, back_to)))

    def replacing(self, *paths: Path) -> None:
        """Files this submission is about to write: their content now put back, or removed when
        there was none. One that cannot be read as a regular file is left as the submission
        made it."""
        for path in paths:
            try:
                before: bytes | None = read_bytes(path, RESTORABLE_BYTES)
                mode = path.stat().st_mode & 0o7777
            except FileNotFoundError:
                before, mode = None, 0
            except (DamagedFile, OSError):
                continue
            self._steps.append((f"put back {path}", lambda p=path, b=before, m=mode: _put_back(p, b, m)))

    def adding_to(self, directory: Path) -> None:
        """A directory this submission adds files to (history/): what it added is removed."""
        before = set(os.listdir(directory)) if directory.is_dir() else set()

        def remove_added() -> None:
            for name in set(os.listdir(directory)) - before if directory.is_dir() else ():
                (directory / name).unlink(missing_ok=True)

        self._steps.append((f"remove what was added to {directory}", remove_added))

    def undo(self, failure: BaseException) -> None:
        """Every step, newest first; one that fails is noted on ``failure`` and the rest go on."""
        for what, step in reversed(self._steps):
            try:
                step()
            except OSError as exc:
                failure.add_note(f"rolling back, could not {what}: {exc.strerror or exc}")


def _put_back(path: Path, content: bytes | None, mode: int) -> None:
    if content is None:
        path.unlink(missing_ok=True)
        return
    try:
        if read_bytes(path, RESTORABLE_BYTES) == content:
            return  # never written: left as it is
    except (FileNotFoundError, DamagedFile):
        pass
    write_bytes_atomic(path, content, mode)
    os.chmod(path, mode)


@contextmanager
def rolled_back_on_failure() -> Iterator[Rollback]:
    undo = Rollback()
    try:
        yield undo
    except BaseException as failure:
        undo.undo(failure)
        raise
