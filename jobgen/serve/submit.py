"""``jobgen serve``: what is served (a run's checkpoint, exported, or a model directory) and
the serve job that serves it, on Slurm or with ``--local`` on this machine.

    jobgen serve RUN [--best | --step N]     # an export of the run's checkpoint, under RUN/served/
    jobgen serve DIR                         # an exported Hugging Face model directory, as it is

For a run, the model is an export of one checkpoint (the newest that loads, the best by eval
loss, or step N) into ``RUN/served/<checkpoint>/``: staged and renamed into place, and reused
while it is there. The export itself is trainer code, which jobgen may not import: the
composition root (jobgen.cli.main) hands it in as an :data:`Exporter`. The job is rendered by
jobgen.serve.render, submitted through jobgen.slurm.client, and its id recorded in
``serve-job.json``; the job writes ``serve.json`` once the server answers
(jobgen.serve.node). A served directory keeps the same names under itself.

One server per run or directory at a time: a second ``jobgen serve`` is refused while one is
queued or running (jobgen.serve.status).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from jobgen.base.atomic import write_json_atomic, write_text_atomic
from jobgen.base.safe_read import DamagedFile
from jobgen.launch import submission as core
from jobgen.launch.executors import Executor, LocalExecutor, LocalJob, SlurmExecutor
from jobgen.launch.submission import Job, Rollback, SubmitError
from jobgen.runs.rundir import RunDir, RunDirError
from jobgen.runs.sweep_runs import find_run_or_point
from jobgen.serve.address import key_problem
from jobgen.serve.records import identity
from jobgen.serve.render import (
    SCRIPT_PROGRAM,
    ServeJob,
    ServeSpecError,
    render_serve,
    serve_job_for_run,
    site_environment,
)
from jobgen.spec.loader import resolve
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.serve import ServeSpec
from jobgen.spec.tables.site import SiteProfile

# (run, checkpoint name or None for the newest that loads, a new directory) → the name of the
# checkpoint exported into that directory. jobgen.cli.main wires trainer.checkpoints.export in.
Exporter = Callable[[RunDir, "str | None", Path], str]
# Files that make a directory a Hugging Face model one can serve.
MODEL_FILES = ("config.json",)


class ServeError(RuntimeError):
    """`jobgen serve` cannot do what was asked; the message says why and what to do."""


@dataclass(frozen=True)
class Target:
    """What `jobgen serve RUN|DIR` names: a training run, or a model directory served as it is.
    ``state`` holds serve.json, serve-job.json, serve.sbatch and logs/serve/ either way."""

    state: RunDir
    spec: ResolvedSpec | None  # None for a model directory

    @property
    def label(self) -> str:
        return f"run {self.state.path.name}" if self.spec else f"model directory {self.state.path}"


def find_target(ref: str, runs_root: Path | None) -> Target:
    """A run (its directory, or its name under the runs root), else a model directory."""
    try:
        run = find_run_or_point(ref, runs_root)
    except RunDirError as exc:
        directory = Path(ref).expanduser()
        if directory.is_dir() and all((directory / name).is_file() for name in MODEL_FILES):
            return Target(RunDir(checked_path(directory.absolute())), None)
        raise ServeError(f"{exc}; nor a model directory (one holds {', '.join(MODEL_FILES)})") from None
    checked_path(run.path)
    try:
        spec = run.load_spec()
    except DamagedFile as exc:  # names the file and the first key that does not validate
        raise ServeError(f"cannot read {exc}") from None
    except OSError as exc:
        reason = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {str(exc)[:200]}"
        raise ServeError(f"cannot read {run.spec_file}: {reason}") from None
    if spec.run.model is None:
        raise ServeError(
            f"{run.path} is a '{spec.run.job.program}' run, which trains no model: serve an exported model "
            "directory instead (jobgen serve DIR)"
        )
    return Target(run, spec)


def checked_path(path: Path) -> Path:
    """``path``, if the serve script can name it: #SBATCH lines are one line each, and a
    backslash in --output turns off Slurm's replacements (the loader refuses such run
    directories; a model directory or a renamed run reaches here)."""
    text = str(path)
    if re.search(r"[\x00-\x08\x0a-\x1f\x7f]", text) or "\\" in text:
        raise ServeError(
            f"cannot serve {text!r}: its path holds a control character (a newline, ...) or a backslash, which "
            "an #SBATCH line cannot hold; rename it"
        )
    return path


# ---------------------------------------------------------------- the model


def exported_model(run: RunDir, checkpoint: str | None, export: Exporter) -> tuple[Path, str]:
    """``RUN/served/<checkpoint>/`` and the checkpoint's name: reused when already exported (a
    directory there appeared by rename, so it is complete), else exported now. ``checkpoint``
    None: the newest that loads."""
    if checkpoint is None:
        complete = run.complete_checkpoints()
        if not complete:
            raise ServeError(f"{run.checkpoints} has no complete checkpoint yet: nothing to serve")
        newest = complete[-1][1].name
        if (run.served / newest).is_dir():
            return run.served / newest, newest
    elif (run.served / checkpoint).is_dir():
        return run.served / checkpoint, checkpoint
    try:
        run.served.mkdir(exist_ok=True)
    except OSError as exc:  # a file of that name, or no permission
        raise ServeError(f"cannot make {run.served}: {exc.strerror} (exports for serving go there)") from None
    # Exported under a name of its own, then renamed to the checkpoint's (known only once the
    # exporter has found the newest that loads); a reader never sees half an export.
    staging = run.served / f".export-{secrets.token_hex(4)}"
    try:
        name = export(run, checkpoint, staging)
        target = run.served / name
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
            # Another `jobgen serve` exported the same checkpoint meanwhile: use that one.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, name


def directory_model_name(directory: Path) -> str:
    """A model name (serve_spec.ModelName) from a directory's name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", directory.name).lstrip("._-")[:128]
    return name or "model"


def site_for_directory(site_ref: str) -> tuple[SiteProfile, str]:
    """The site profile as a run would get it (relative paths made absolute), with its file:
    a minimal spec is resolved and only its site is used."""
    from jobgen.spec.loader import SpecError

    try:
        spec = resolve(
            {"site": site_ref, "job": {"name": "serve", "program": "doctor", "time": "1h"}},
            spec_file=None,
            base_dir=Path.cwd(),
        )
    except SpecError as exc:
        raise ServeError("; ".join(str(issue) for issue in exc.issues)) from None
    return spec.site, str(spec.site_file)


def serve_job(
    target: Target,
    *,
    export: Exporter,
    best: bool = False,
    step: int | None = None,
    time_limit: int | None = None,
    site_ref: str | None = None,
) -> ServeJob:
    """The serve job for ``target``: the checkpoint chosen and exported for a run, the
    directory as it is otherwise; ``time_limit`` (seconds) overrides serve.time."""
    if target.spec is None:
        if best or step is not None:
            raise ServeError("--best and --step choose a checkpoint of a run; a model directory is served as it is")
        site, site_file = site_for_directory(site_ref or os.environ.get("JOBGEN_SITE", "local"))
        directory = target.state.path
        job = ServeJob(
            name=f"{directory_model_name(directory)}-serve",
            state_dir=directory,
            model_dir=directory,
            model_name=directory_model_name(directory),
            serve=ServeSpec(),
            site=site,
            site_file=site_file,
            env=site_environment(site),
            partition=site.slurm.partition,
            account=site.slurm.account,
            qos=site.slurm.qos,
            constraint=site.slurm.constraint,
        )
    else:
        if site_ref:
            raise ServeError("--site is for a model directory; a run is served with its own site profile")
        try:
            chosen = target.state.checkpoint_for(best=best, step=step)
        except RunDirError as exc:
            raise ServeError(str(exc)) from None
        model_dir, checkpoint = exported_model(target.state, chosen, export)
        job = serve_job_for_run(target.spec, model_dir, checkpoint, state_dir=target.state.path)
    if time_limit is not None:
        job = replace(job, serve=job.serve.model_copy(update={"time": time_limit}))
    try:
        job.check()
    except ServeSpecError as exc:
        raise ServeError(str(exc)) from None
    check_api_key(job.serve.api_key_env)
    return job


def check_api_key(name: str | None) -> None:
    """serve.api_key_env must name a usable key in this shell: sbatch passes it to the job
    from here (and `--local` runs here). Refused now rather than a job that fails at start."""
    problem = None if name is None else key_problem(os.environ.get(name, ""))
    if problem:
        raise ServeError(
            f"serve.api_key_env: ${name} {problem} in this shell: export it before `jobgen serve` (the job gets "
            "it from here, and jobgen never writes it)"
        )


# ---------------------------------------------------------------- starting it


def write_script(job: ServeJob) -> Path:
    """serve.sbatch in the state directory, and the directory its log goes to."""
    state = RunDir(job.state_dir)
    try:
        state.serve_log("x").parent.mkdir(parents=True, exist_ok=True)
        script = state.script(SCRIPT_PROGRAM)
        write_text_atomic(script, render_serve(job), mode=0o777)
    except OSError as exc:
        raise ServeError(f"cannot write into {state.path}: {exc.strerror} (the server's address goes there)") from None
    return script


class ServeSubmission(core.Submission):
    """A served model's job: serve.sbatch, queued or run here, recorded in serve-job.json."""

    script_name = f"{SCRIPT_PROGRAM}.sbatch"

    def __init__(self, job: ServeJob):
        self.job = job
        self.state = RunDir(job.state_dir)

    def render(self) -> str:
        return render_serve(self.job)

    def read_quarantine(self) -> list[str]:
        """The run's quarantined nodes (none for a model directory served as it is)."""
        return core.quarantined_nodes(self.state.path) if self.state.exists() else []

    def options(self) -> list[str]:
        return core.exclude_option(self.job.exclude, self.quarantined)

    def materialise(self, undo: Rollback) -> Path:
        undo.replacing(self.state.script(SCRIPT_PROGRAM))
        return write_script(self.job)

    def record(self, job: Job) -> None:
        script = str(self.state.script(SCRIPT_PROGRAM))
        if not job.local:
            _record(self.job, job.job_id, script=script)
            return
        # The pid with its start time and boot: --stop signals it only while it is this process.
        pid = identity(job.process.pid)
        _record(self.job, job.job_id, local=True, host=socket.gethostname(), script=script, **pid)


def _record(job: ServeJob, job_id: int, **extra: object) -> None:
    write_json_atomic(
        RunDir(job.state_dir).serve_job,
        {
            "job_id": str(job_id),
            "model": job.model_name,
            "model_dir": str(job.model_dir),
            "checkpoint": job.checkpoint,
            "engine": job.serve.engine,
            "api_key_env": job.serve.api_key_env,
            "time_limit_seconds": job.serve.time,
            "submitted_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            **extra,
        },
    )


def submit_serve(job: ServeJob) -> int:
    """sbatch the serve job; the run's quarantined nodes join its --exclude on the command line."""
    job_id = _submitted(ServeSubmission(job), SlurmExecutor()).job_id
    assert job_id is not None  # not a dry run
    return job_id


def local_job(job: ServeJob) -> LocalJob:
    """The serve job as a one-node job on this machine, until serve.time."""
    state = RunDir(job.state_dir)
    return LocalJob(
        name=job.name,
        nodes=1,
        cpus=job.cpus,
        container=job.site.python.kind == "container",
        without_container="serve on the cluster, or use a venv site",
        log=state.serve_log,
        time_limit=job.serve.time,
    )


def run_local(job: ServeJob, echo: Callable[[bytes], None]) -> int:
    """The serve script on this machine, in the foreground, until serve.time, Ctrl-C, SIGTERM or
    `jobgen serve --stop`: each ends it as Slurm's time limit would (SIGTERM to the script)."""
    done = _submitted(ServeSubmission(job), LocalExecutor(local_job(job), echo))
    assert done.exit_status is not None  # a local job runs in the foreground
    return done.exit_status


def _submitted(submission: ServeSubmission, executor: Executor) -> core.Submitted:
    """The submission core's refusal in serve's words: one ServeError."""
    try:
        return core.submit(submission, executor)
    except SubmitError as exc:
        raise ServeError("\n  ".join(f.message for f in exc.findings)) from None
