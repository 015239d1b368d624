"""Render the sbatch script for a resolved spec: a pure function of (spec, site) → text.

This module owns what goes into the script: the ``#SBATCH`` directives
(:func:`sbatch_directives`) and every value the templates print (:func:`build_context`);
``sbatch_templates/`` holds the shell logic only. Names in the run directory come
from :class:`jobgen.runs.rundir.RunDir`; the ones that hold the job id or the restart
count reach the script as shell expressions built from RunDir's own names.

Nothing here runs a subprocess or looks at the cluster; :mod:`jobgen.launch.preflight`
does that. Every number in the script (nodes, processes, ports, thread counts) is
derived here from the one spec, and every value interpolated into the script is
shell-quoted by the Jinja environment's ``finalize`` hook unless it is a
:class:`Trusted` literal built below. ``#SBATCH`` lines are parsed by sbatch, not
by a shell, so their values are quoted the way sbatch reads them (:func:`sbatch_arg`);
comment lines take text through the ``comment`` filter.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from pathlib import Path
from typing import Any

import jinja2

from jobgen import __version__
from jobgen.base.durations import format_slurm
from jobgen.base.exit_codes import ExitCode
from jobgen.base.paths import CHECKOUT, TEMPLATES_DIR
from jobgen.launch.container_step import container_words, job_directories
from jobgen.launch.supervision import hang_timeout, supervision_context
from jobgen.program import placeholders
from jobgen.runs.rundir import STARTUP_SWITCHES, RunDir
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.run import JobSpec
from jobgen.spec.tables.site import PythonSettings

# How long the start probe waits for every node's answer (site.health_check's budget).
PROBE_TIMEOUT_SECONDS = 60
# What sbatch's #SBATCH parser (src/sbatch/opt.c, get_argument) reads as one argument
# as it stands: no whitespace, quote or backslash, and no '#', which starts a comment there.
_SBATCH_BARE = re.compile(r"^[A-Za-z0-9_.:/@+=,\[\]&|()*!~%^-]+$")
# sbatch reads the script line by line: no quoting carries a newline into an #SBATCH value.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class Trusted(str):
    """Text built by jobgen itself that must reach the script verbatim."""


def _one_line(text: str) -> str:
    """``text``, which goes into the script as one quoted word. No quoting keeps a newline in
    its place: a line of it equal to a here-document's delimiter ends the document, and the
    lines after it run as commands. The loader refuses such values with their key; reaching
    here is a jobgen bug, and the script is not written."""
    if _CONTROL.search(text):
        raise ValueError(f"refusing to put {text!r} into the batch script: it holds a control character")
    return text


def _finalize(value: Any) -> str:
    if value is None:
        raise jinja2.UndefinedError("a template printed None; guard optional values with {% if %}")
    if isinstance(value, Trusted):
        return value
    if isinstance(value, bool):
        raise jinja2.UndefinedError("a template printed a boolean; use it in {% if %}")
    return shlex.quote(_one_line(str(value)))


def sbatch_arg(value: Any) -> Trusted:
    """One argument of an #SBATCH line: bare when sbatch would read it as is, else in double
    quotes with backslash, double quote and '#' escaped. sbatch (22.05 and the older parsers
    that knew only double quotes) reads ``"--comment=my run"`` as the one argument
    ``--comment=my run``; bash sees a comment either way."""
    text = str(value)
    if _SBATCH_BARE.match(text):
        return Trusted(text)
    if not text or _CONTROL.search(text):
        # The loader refuses these (SbatchOption, the run dir check); reaching here is a jobgen bug.
        raise ValueError(f"refusing to put {text!r} into an #SBATCH line")
    return Trusted('"' + re.sub(r'([\\"#])', r"\\\1", text) + '"')


def _comment(value: Any) -> Trusted:
    """Text for a comment line that must stay one line whatever it holds (a directory name
    may contain a newline): printable text as is, anything else as a Python literal."""
    text = str(value)
    return Trusted(text if text.isprintable() else repr(text))


def slurm_filename_literal(path: str) -> str:
    """``path`` inside a Slurm filename pattern (--output): '%%' is a literal '%'. A backslash
    anywhere turns every replacement off (%x, %j too), so the loader refuses run dirs with one."""
    if "\\" in path:
        raise ValueError(f"refusing to put {path!r} into a Slurm filename pattern")
    return path.replace("%", "%%")


def _single_quoted(value: Any) -> Trusted:
    """Always single-quoted, even when shlex would leave it bare (shellcheck reads a bare
    comma inside an array as a mistaken separator)."""
    return Trusted("'" + _one_line(str(value)).replace("'", "'\"'\"'") + "'")


def template_environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        finalize=_finalize,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["comment"] = _comment
    env.filters["trusted"] = Trusted
    env.filters["sq"] = _single_quoted
    return env


def script_name(spec: ResolvedSpec) -> str:
    """The script's file name in the run directory (and in ``jobgen render -o DIR``)."""
    return RunDir(spec.run_dir).script(spec.run.job.program).name


def sbatch_directives(spec: ResolvedSpec) -> list[Trusted]:
    """The script's ``#SBATCH`` options, in order, one argument each, quoted as sbatch reads
    them (:func:`sbatch_arg`); ``_header.j2`` prints one ``#SBATCH`` line per entry."""
    job, slurm = spec.run.job, spec.site.slurm
    run = RunDir(spec.run_dir)

    def option(name: str, value: Any = None) -> Trusted:
        return Trusted(f"--{name}" if value is None else f"--{name}={sbatch_arg(value)}")

    directives = [
        option("job-name", job.name),
        # job.min_nodes: a range; Slurm gives as many as are free (with --exclusive, below).
        option("nodes", job.allocated_nodes if len(job.node_counts) == 1 else f"{job.min_nodes}-{job.nodes}"),
    ]
    # Spares: Slurm keeps the allocation when a node fails (and takes it out), the next launch uses a spare.
    directives += [option("no-kill")] if job.spare_nodes else []
    # With --ntasks-per-node, Slurm 22.05 starts a node range on its minimum even with every
    # node free (measured on the dev cluster); the script's sruns name their tasks themselves.
    if len(job.node_counts) == 1:
        directives.append(option("ntasks-per-node", 1))
    directives += [
        option("cpus-per-task", slurm.cpus_per_node),
    ]
    if slurm.gpus_per_node:
        directives.append(sbatch_arg(gpu_request(spec)))
    if slurm.mem:
        directives.append(option("mem", slurm.mem))
    directives.append(option("time", format_slurm(job.time)))
    for name, value in (
        ("partition", spec.partition),
        ("account", spec.account),
        ("qos", spec.qos),
        ("constraint", spec.constraint),
        ("reservation", slurm.reservation),
        ("exclude", ",".join(job.exclude)),
        ("nodelist", ",".join(job.nodelist)),
    ):
        if value:
            directives.append(option(name, value))
    # Slurm 22.05 starts a node range on its minimum even with every node idle, unless the job
    # takes whole nodes and names no tasks per node (measured on the dev cluster).
    if slurm.exclusive or len(job.node_counts) > 1:
        directives.append(option("exclusive"))
    if slurm.hint_nomultithread:
        directives.append(option("hint", "nomultithread"))
    # --chdir takes the path literally; --output expands %-patterns in all of it (%x: the
    # job name, which is the run directory's name; %j: the job id).
    batch_log = run.batch_log("%x", "%j").relative_to(run.path)
    directives += [
        option("chdir", run.path),
        option("output", f"{slurm_filename_literal(str(run.path))}/{batch_log}"),
        option("open-mode", "append"),
    ]
    if job.graceful_stop:
        directives.append(option("signal", f"B:{slurm.signal}@{job.exit_grace}"))
    directives += [
        option("requeue" if slurm.requeue else "no-requeue"),
    ]
    directives += [sbatch_arg(extra) for extra in slurm.extra_sbatch]
    return directives


def gpu_request(spec: ResolvedSpec) -> str:
    """The job's GPU request. Equal nodes: one GPU per process on every node (--gres or
    --gpus-per-node; ResolvedSpec.gpus_per_node). Unequal nodes (job.procs_per_node as a list): one GPU per process for
    the whole job (--gpus=N, typed as gres_name is), which Slurm splits over job.nodelist's
    nodes by what each has: a per-node request would ask every node for the most any needs.
    Preflight checks that the nodes leave Slurm one way to split them (measured on 22.05:
    --gpus=4 on nodes of 3 and 1 GPUs gives each node all of its own)."""
    slurm = spec.site.slurm
    if spec.run.job.unequal_nodes:
        typed = slurm.gres_name.split(":")[1:]  # "gpu:h100" -> h100
        return f"--gpus={':'.join([*typed, str(sum(spec.node_procs))])}"
    gpus = spec.gpus_per_node
    return f"--gres={slurm.gres_name}:{gpus}" if slurm.gpu_request == "gres" else f"--gpus-per-node={gpus}"


# The batch shell's spelling of what RunDir's names take as arguments: this job, this
# attempt of it (a requeued job keeps its id), and, in the script srun runs on every node,
# the node.
SHELL_JOB_ID = "$SLURM_JOB_ID"
SHELL_RESTART = "${SLURM_RESTART_COUNT:-0}"
SHELL_NODE = "${SLURMD_NODENAME:-local}"


def _shell_path(base_expr: str, base: Path, path: Path) -> Trusted:
    """``path``, a RunDir name under ``base``, as one double-quoted word of the script:
    ``base_expr`` (the script's variable for ``base``, "$RUN_DIR") and the relative name,
    whose own shell expressions ($SLURM_JOB_ID...) expand when the script runs."""
    return Trusted(f'"{base_expr}/{path.relative_to(base)}"')


def build_context(spec: ResolvedSpec) -> dict[str, Any]:
    """Every value the template needs, derived from the spec in one place."""
    context = {**_job_context(spec), **_run_dir_context(spec), **_site_context(spec)}
    supervision = supervision_context(spec, context["forward_signal"], context["container_words"])
    # JSON in a quoted here-document, which no shell expands: no line of it is a bare word (its
    # strings hold no newline), so none can end the document.
    return {**context, **{key: Trusted(value) for key, value in supervision.items()}}


def _job_context(spec: ResolvedSpec) -> dict[str, Any]:
    """The job's part of :func:`build_context`: where the script came from, what it starts,
    and the numbers of its allocation."""
    job, slurm = spec.run.job, spec.site.slurm
    procs = spec.procs_per_node  # the most on one node: what every node's request covers
    timeout = hang_timeout(spec)
    unequal = job.unequal_nodes
    return {
        "jobgen_version": __version__,
        "spec_file": spec.spec_file or "(built in)",
        "site_name": spec.site.name,
        "site_file": spec.site_file,
        "program": job.program,
        "lifecycle": job.resumable,
        "entry_words": entry_words(spec),
        "command_workdir": spec.run.command.workdir if spec.run.command else None,
        "command_plan": job.kind.planned,
        # What the batch shell forwards to a program that does not read jobgen's stop request.
        "forward_signal": forward_signal(spec),
        "command_line": command_line(spec),
        "script_name": script_name(spec),
        "sbatch_directives": sbatch_directives(spec),
        "nodes": job.nodes,
        "min_nodes": job.min_nodes or job.nodes,
        "procs_per_node": procs,
        "layout": Trusted(spec.layout),
        "world_size": spec.world_size,
        "task_world_size": task_world_size(spec, "SLURM_JOB_NUM_NODES"),
        # job.procs_per_node as a list: bash arrays the node scripts index by $SLURM_NODEID
        # (each node's processes and OpenMP threads), and torchrun's count read from them.
        "node_procs": Trusted(" ".join(map(str, spec.node_procs))) if unequal else None,
        "node_threads": Trusted(" ".join(str(_omp_threads(spec, n)) for n in spec.node_procs)) if unequal else None,
        "nproc": Trusted('"$NPROC"') if unequal else procs,
        # c10d numbers the nodes by their --local-addr strings ("10.0.0.10" before "10.0.0.9");
        # static takes each node's rank from $SLURM_NODEID, so ranks follow the list (docs/run-toml.md).
        "rdzv_backend": "static" if unequal else "c10d",
        "cpus_per_task": slurm.cpus_per_node,
        "omp_threads": _omp_threads(spec, procs),
        "gpus_per_node": spec.gpus_per_node,
        # GPUs asked for the whole job (--gpus, unequal nodes: gpu_request), not per node.
        "job_wide_gpus": bool(slurm.gpus_per_node) and unequal,
        "time_seconds": job.time,
        "exit_grace_seconds": job.exit_grace,
        # On SIGTERM torchrun's agent gives its workers this long to save before SIGKILL
        # (its default, 30 s, cuts saves short): the lead time the spec budgets for a save.
        "shutdown_timeout_seconds": job.exit_grace,
        "signal": slurm.signal,
        "graceful_stop": job.graceful_stop,
        "array": job.array,
        "in_job_restarts": spec.in_job_restarts,
        **_launch_nodes_context(job),
        # The supervisor's hang watch (train.hang_timeout) runs beside every launch of a task that relaunches.
        "hang_timeout": timeout,
        "snapshot_dir": _snapshot_dir(spec),
    }


def _launch_nodes_context(job: JobSpec) -> dict[str, Any]:
    """Which nodes a launch trains on. With job.spare_nodes the task holds allocated_nodes and
    each launch trains on job.nodes of them, chosen by the supervisor as it starts ($JOBGEN_LAUNCH_NODES); else every
    launch is on the whole allocation."""
    spares = job.spare_nodes
    return {
        "spare_nodes": spares,
        "allocated_nodes": job.allocated_nodes,
        "launch_nodes": Trusted(
            f'--nodes={job.nodes} --ntasks={job.nodes} --nodelist="$JOBGEN_LAUNCH_NODES"'
            if spares
            else '--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES"'
        ),
    }


def _snapshot_dir(spec: ResolvedSpec) -> Trusted | None:
    """Where a relaunching trainer keeps its memory snapshots (train.snapshot_every_steps): on
    the node's tmpfs, per user, run (its path's hash: any text) and attempt of the job."""
    if not (spec.in_job_restarts and spec.run.job.kind.trains and spec.run.train.snapshot_every_steps):
        return None
    run_key = hashlib.sha256(str(spec.run_dir).encode()).hexdigest()[:16]
    root = shlex.quote(spec.site.paths.snapshot_dir)
    return Trusted(f'{root}/jobgen-"$(id -u)/{run_key}/$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"')


def _omp_threads(spec: ResolvedSpec, procs: int) -> int:
    """One OpenMP thread pool per process, splitting the node's CPUs between its ``procs``."""
    return max(1, spec.site.slurm.cpus_per_node // procs)


def task_world_size(spec: ResolvedSpec, nodes_var: str) -> Trusted:
    """The task's world size as the script knows it: the nodes Slurm gave (``$nodes_var``,
    which job.min_nodes lets vary) x procs_per_node; a list's world is its sum (a list
    forbids job.min_nodes, so the nodes are job.nodes; so do spares, which the allocation's
    count includes)."""
    if spec.run.job.unequal_nodes or spec.run.job.spare_nodes:
        return Trusted(str(spec.world_size))
    return Trusted(f"$(({nodes_var} * {spec.procs_per_node}))")


def _run_dir_context(spec: ResolvedSpec) -> dict[str, Any]:
    """The run directory's part of :func:`build_context`: its path and the names in it."""
    run_dir = spec.run_dir
    run = RunDir(run_dir)
    # Every stop request an earlier attempt of this job can have left: the stem and the
    # stem with any restart count (RunDir.stop_request_stem).
    stale_stop = _shell_path("$SWITCHES", run.switches, run.stop_request_stem("${SLURM_JOB_ID:-none}"))
    return {
        "run_dir": str(run_dir),
        # The run directory's names (jobgen.runs.rundir). Absolute where nothing in them varies;
        # else under the script's $RUN_DIR / $SWITCHES / $JOBGEN_RUN_DIR, with the job id,
        # the restart count and the node as the shell spells them at run time.
        "failed_marker": str(run.failed_marker),
        "done_marker": str(run.done_marker),
        "switches_dir": _shell_path("$RUN_DIR", run.path, run.switches),
        "startup_switches": Trusted(" ".join(shlex.quote(name) for name in STARTUP_SWITCHES)),
        "stale_stop_requests": Trusted(f"{stale_stop} {stale_stop}.*"),
        "task_record": _shell_path("$RUN_DIR", run.path, run.task_record("${SLURM_JOB_ID:-none}", SHELL_RESTART)),
        "repro_dir": _shell_path("$RUN_DIR", run.path, run.repro(SHELL_JOB_ID)),
        # srun expands %j and %N (job id, node) in --output. The job name is written out, not
        # %x: inside a sweep %x is the sweep's name (the array's), not this point's.
        "node_log": _shell_path(
            "$JOBGEN_RUN_DIR", run.path, run.node_log(slurm_filename_literal(spec.run.job.name), "%j", "%N")
        ),
        # In the node script srun runs on each node (only the environment reaches it).
        "rank_logs": _shell_path("$JOBGEN_RUN_DIR", run.path, run.rank_logs(SHELL_JOB_ID, SHELL_NODE)),
        # NCCL expands %h (host) and %p (pid), and reads '%%' as '%': a '%' in the run dir is doubled.
        "nccl_debug_log": _shell_path("${RUN_DIR//\\%/%%}", run.path, run.nccl_debug_log(SHELL_JOB_ID, "%h", "%p")),
    }


def python_context(spec: ResolvedSpec, env_names: list[str]) -> dict[str, Any]:
    """What ``_python_env.j2`` needs for a run, whose script exports ``env_names`` itself: the
    run's script and a sweep's (jobgen.sweep.render) take it from here."""
    return environment_context(spec.site.python, job_directories(spec), env_names, gpus=bool(spec.gpus_per_node))


def environment_context(
    py: PythonSettings, shared: list[str], env_names: list[str] = (), *, gpus: bool = False
) -> dict[str, Any]:
    """What ``_python_env.j2`` needs (the job's Python: venv, conda environment, prefix, modules
    or container image), with ``shared`` the directories a container must see at their paths
    (the first is where its steps start) and ``env_names`` the variables the script exports."""
    return {
        # jobgen's own checkout, when it runs from one (pip install -e): on PYTHONPATH and in the
        # container. An installed jobgen is the environment's own.
        "checkout": str(CHECKOUT) if CHECKOUT else None,
        "python": py,
        "python_modules": list(py.modules) if py.kind != "container" else [],
        "venv": py.venv if py.kind == "venv" else py.module_venv if py.kind == "modules" else None,
        "activation_file": py.activation_file,
        "container_words": container_words(py, shared, list(env_names), gpus),
        # The batch host's Python, outside any image: the supervisor's.
        "host_python": py.host_python if py.kind == "container" else None,
    }


def _site_context(spec: ResolvedSpec) -> dict[str, Any]:
    """The site's part of :func:`build_context`: Python, network, environment, the start
    probe, and the exit codes."""
    site = spec.site
    slurm, net = site.slurm, site.network
    env, per_task = job_env(spec)
    names = _names_of(env, net.env)

    return {
        **python_context(spec, names),
        "output_per_node": slurm.output_per_node,
        "ifname": net.ifname,
        "transport": net.transport,
        "ib_hca": net.ib_hca,
        "resolve_head_ip": net.resolve_head_ip,
        "rdzv_port": net.rdzv_port,
        "rdzv_port_spread": net.rdzv_port_spread,
        "net_debug": net.debug,
        "net_env": sorted(net.env.items()),
        "env": sorted(env.items()),
        "env_per_task": per_task,
        # The names the spec exports itself: env.txt records their values (jobgen.launch.repro).
        "repro_own": Trusted("".join(f" --own {shlex.quote(name)}" for name in names)),
        "exit": {code.name.lower(): int(code) for code in ExitCode},
        # The start probe (every node, before the launch): what it checks. The doctor runs it
        # too, so that `jobgen doctor --clear` releases a node only if the site's check passes.
        "probe": bool(site.health_check or slurm.gpus_per_node or site.python.activation_file),
        "health_check": site.health_check,
        "probe_gpus": spec.gpus_per_node,
        # Where ranks compute on the GPUs, the probe also asks the driver (nvidia-smi) what it sees.
        "probe_driver": slurm.computes_on_gpu,
        "probe_timeout_seconds": PROBE_TIMEOUT_SECONDS,
        # How Slurm records each code (jobgen.base.exit_codes): planned stops exit 0 (COMPLETED).
        "planned_exit_codes": Trusted(" ".join(str(int(code)) for code in ExitCode if code.planned)),
        "exit_words": [(int(code), code.reason) for code in ExitCode],
    }


def job_env(spec: ResolvedSpec) -> tuple[dict[str, str], list[str]]:
    """What the batch shell exports (the site's [env], HF_HOME, the run's [env]), and the names
    of the run's [env] it leaves to the launcher."""
    env = dict(spec.site.env)
    if spec.site.paths.hf_home:
        env.setdefault("HF_HOME", spec.site.paths.hf_home)
    run_env, per_task = _run_env(spec)
    env.update(run_env)
    for name in per_task:  # the launcher's value replaces the site's; the shell exports neither
        env.pop(name, None)
    return env, per_task


def exported_names(spec: ResolvedSpec) -> list[str]:
    """The names of every variable the run's script exports from the spec: a container step
    passes them in by name (podman), or over the image's own values (pyxis)."""
    return _names_of(job_env(spec)[0], spec.site.network.env)


def _names_of(env: dict[str, str], network_env: dict[str, str]) -> list[str]:
    return sorted({*env, *network_env})


def _run_env(spec: ResolvedSpec) -> tuple[dict[str, str], list[str]]:
    """[env] as the batch shell exports it, and the names it leaves to the launcher. A command
    program's values are placeholder templates (jobgen.program.placeholders): one naming a placeholder
    is set for each task by jobgen's launcher from the task's plan, never by the shell; the
    others lose only the doubling of their literal braces."""
    if not spec.run.job.kind.planned:
        return dict(spec.run.env), []
    per_task = sorted(name for name, value in spec.run.env.items() if placeholders.uses_placeholders(value))
    fixed = {name: placeholders.expand(value, {}) for name, value in spec.run.env.items() if name not in per_task}
    return fixed, per_task


def forward_signal(spec: ResolvedSpec) -> str | None:
    """The signal the batch shell passes on to your own program's processes when Slurm's
    lead-time signal arrives ([command] stop_signal), or None: the bundled programs, and a
    program that reads jobgen's stop request (hf_trainer, jobgen.runtime), need none."""
    command = spec.run.command
    if command is None or command.stop_signal in (None, "none"):
        return None
    return command.stop_signal


def entry_words(spec: ResolvedSpec) -> Trusted:
    """What torchrun starts on every node, after its own options: jobgen's program with the
    run directory, or, for your own program, jobgen's launcher with this attempt's plan (the
    module or script and its arguments are in the plan: jobgen.launch.command_plan)."""
    kind = spec.run.job.kind  # its module: jobgen's program, or jobgen's launcher of yours
    if kind.planned:
        run = RunDir(spec.run_dir)
        plan = _shell_path("$JOBGEN_RUN_DIR", run.path, run.command_plan(SHELL_JOB_ID, SHELL_RESTART))
        return Trusted(f"-m {kind.module} --plan {plan}")
    # On each node (the node script): the nodes Slurm gave this task, which job.min_nodes lets vary.
    world = task_world_size(spec, "SLURM_NNODES")
    world = world if spec.run.job.unequal_nodes else Trusted(f'"{world}"')
    return Trusted(f'-m {kind.module} --run-dir "$JOBGEN_RUN_DIR" --expected-world-size {world}')


def command_line(spec: ResolvedSpec) -> str | None:
    """What a command program runs, for a comment of the script: the module or script and its
    arguments as written (placeholders unexpanded), quoted as a shell would need them."""
    command = spec.run.command
    if command is None:  # [command] is there exactly when the program is your own (RunSpec)
        return None
    words = ["-m", command.module] if command.module else [command.script]
    line = shlex.join([*words, *command.args])
    return line + (f" [+ when resuming: {shlex.join(command.resume_args)}]" if command.resume_args else "")


def render(spec: ResolvedSpec) -> str:
    """The batch script for ``spec`` (train or doctor), as text."""
    return template_environment().get_template("torchrun.sbatch.j2").render(**build_context(spec))
