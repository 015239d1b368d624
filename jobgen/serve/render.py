"""The serve job's batch script: a pure function of what is served and where → text.

A :class:`ServeJob` holds every input: the site profile, the ``[serve]`` table, the run's
Slurm keys and ``[env]``, the model directory and the name clients use. :func:`render_serve`
turns it into the script, with the ``#SBATCH`` directives built here as data
(:func:`serve_directives`) and ``sbatch_templates/serve.sbatch.j2`` holding the shell logic
only. The script activates the site's Python and exports the site's and the run's
environment exactly as the training script does (``template_environment.j2``), then runs
``python -m jobgen.serve.node`` (jobgen.serve.node) on its one node. Every value a user typed
is shell-quoted by the Jinja environment of jobgen.launch.render, or quoted as sbatch reads it.

Nothing here runs a subprocess or looks at the file system.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobgen import __version__
from jobgen.base.durations import format_human, format_slurm
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.render import Trusted, environment_context, sbatch_arg, slurm_filename_literal, template_environment
from jobgen.runs.rundir import RunDir
from jobgen.serve.node import STOP_GRACE_SECONDS
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.serve import ServeSpec
from jobgen.spec.tables.site import SiteProfile

SCRIPT_PROGRAM = "serve"  # RunDir.script("serve"): serve.sbatch


class ServeSpecError(ValueError):
    """[serve] asks for what the site cannot give; the message names the key."""


@dataclass(frozen=True)
class ServeJob:
    """Everything the serve script is rendered from."""

    name: str  # Slurm's job name
    state_dir: Path  # the run directory, or the model directory served as it is
    model_dir: Path
    model_name: str
    serve: ServeSpec
    site: SiteProfile
    site_file: str | None
    spec_file: str | None = None
    checkpoint: str | None = None  # the run's checkpoint the model was exported from
    env: dict[str, str] = field(default_factory=dict)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        """serve.gpus, else one GPU on GPU sites and none on CPU sites."""
        if self.serve.gpus is not None:
            return self.serve.gpus
        return 1 if self.site.slurm.gpus_per_node else 0

    @property
    def cpus(self) -> int:
        return self.serve.cpus or self.site.slurm.cpus_per_node

    def check(self) -> None:
        """What no pydantic model can see alone: [serve] against the site profile."""
        gpus_per_node, cpus_per_node = self.site.slurm.gpus_per_node, self.site.slurm.cpus_per_node
        if self.gpus > gpus_per_node:
            raise ServeSpecError(
                f"serve.gpus: {self.gpus} GPU(s) asked for, but the site '{self.site.name}' has "
                f"{gpus_per_node} per node (slurm.gpus_per_node)"
            )
        if self.cpus > cpus_per_node:
            raise ServeSpecError(
                f"serve.cpus: {self.cpus} CPUs asked for, but the site '{self.site.name}' has {cpus_per_node} per node "
                "(slurm.cpus_per_node)"
            )


def site_environment(site: SiteProfile, run_env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables the job exports, as the training script gets them: the site's, HF_HOME,
    then the run's [env], which wins."""
    env = dict(site.env)
    if site.paths.hf_home:
        env.setdefault("HF_HOME", site.paths.hf_home)
    env.update(run_env or {})
    return env


def serve_job_for_run(spec: ResolvedSpec, model_dir: Path, checkpoint: str | None, *, state_dir: Path) -> ServeJob:
    """The serve job of a run: its site, [serve], Slurm keys and [env]. ``state_dir`` is the run
    directory `jobgen serve` was given: spec.json's run_dir says where the run was made, and a
    run directory copied or moved since is served where it is now."""
    job, serve = spec.run.job, spec.run.serve
    return ServeJob(
        name=f"{job.name}-serve",
        state_dir=state_dir,
        model_dir=model_dir,
        model_name=serve.model_name or job.name,
        serve=serve,
        site=spec.site,
        site_file=spec.site_file,
        spec_file=spec.spec_file,
        checkpoint=checkpoint,
        env=site_environment(spec.site, spec.run.env),
        partition=serve.partition or spec.partition,
        account=spec.account,
        qos=spec.qos,
        constraint=spec.constraint,
        exclude=tuple(job.exclude),
    )


def serve_directives(job: ServeJob) -> list[Trusted]:
    """The serve script's ``#SBATCH`` options, one argument each, quoted as sbatch reads them."""
    slurm = job.site.slurm
    run = RunDir(job.state_dir)

    def option(name: str, value: Any = None) -> Trusted:
        return Trusted(f"--{name}" if value is None else f"--{name}={sbatch_arg(value)}")

    directives = [
        option("job-name", job.name),
        option("nodes", 1),
        option("ntasks", 1),
        option("cpus-per-task", job.cpus),
    ]
    if job.gpus:
        gres = f"--gres={slurm.gres_name}:{job.gpus}" if slurm.gpu_request == "gres" else f"--gpus-per-node={job.gpus}"
        directives.append(sbatch_arg(gres))
    mem = job.serve.mem or slurm.mem
    if mem:
        directives.append(option("mem", mem))
    directives.append(option("time", format_slurm(job.serve.time)))
    for name, value in (
        ("partition", job.partition),
        ("account", job.account),
        ("qos", job.qos),
        ("constraint", job.constraint),
        ("reservation", slurm.reservation),
        ("exclude", ",".join(job.exclude)),
    ):
        if value:
            directives.append(option(name, value))
    log = run.serve_log("%j").relative_to(run.path)
    directives += [
        option("chdir", run.path),
        option("output", f"{slurm_filename_literal(str(run.path))}/{log}"),
        option("open-mode", "append"),
        # A requeued server would come back at another address, in a job nobody waits for.
        option("no-requeue"),
    ]
    directives += [sbatch_arg(extra) for extra in slurm.extra_sbatch]
    return directives


def build_serve_context(job: ServeJob) -> dict[str, Any]:
    """Every value serve.sbatch.j2 and template_environment.j2 print."""
    site, serve = job.site, job.serve
    net, py = site.network, site.python
    run = RunDir(job.state_dir)
    served = [job.state_dir] if job.model_dir.is_relative_to(job.state_dir) else [job.state_dir, job.model_dir]
    return {
        "jobgen_version": __version__,
        "spec_file": job.spec_file or "(none)",
        "site_name": site.name,
        "script_name": run.script(SCRIPT_PROGRAM).name,
        "sbatch_directives": serve_directives(job),
        "run_dir": str(job.state_dir),
        "model_dir": str(job.model_dir),
        "model_name": job.model_name,
        "checkpoint": job.checkpoint,
        "engine": serve.engine,
        "gpus": job.gpus,
        "cpus": job.cpus,
        "dtype": serve.dtype,
        "host": serve.host,
        "port": serve.port,
        "expose": serve.expose,
        "api_key_env": serve.api_key_env,
        "time_human": format_human(serve.time),
        "ready_timeout_seconds": serve.ready_timeout,
        "stop_grace_seconds": int(STOP_GRACE_SECONDS),
        "engine_args": list(serve.args),
        "engine_args_literal": any("$" in arg or "`" in arg for arg in serve.args),
        # template_environment.j2: the site's Python and network, the job's variables.
        **environment_context(py, [str(path) for path in served], gpus=bool(job.gpus)),
        "launch_error_exit": int(ExitCode.LAUNCH_ERROR),
        "ifname": net.ifname,
        "transport": net.transport,
        "ib_hca": net.ib_hca,
        "net_debug": net.debug,
        "nccl_debug_log": Trusted('"${RUN_DIR//\\%/%%}/logs/serve/nccl-$SLURM_JOB_ID-%h-%p.log"'),
        "net_env": sorted(net.env.items()),
        "env": sorted(job.env.items()),
        "env_per_task": [],  # placeholders are a training task's (jobgen.launch.command_plan)
    }


def render_serve(job: ServeJob) -> str:
    """The serve job's batch script, as text."""
    return template_environment().get_template("serve.sbatch.j2").render(**build_serve_context(job))
