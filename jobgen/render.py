"""Render the sbatch script for a resolved spec: a pure function of (spec, site) → text.

Nothing here runs a subprocess or looks at the cluster; :mod:`jobgen.preflight`
does that. Every number in the script (nodes, processes, ports, thread counts) is
derived here from the one spec, and every value interpolated into the script is
shell-quoted by the Jinja environment's ``finalize`` hook unless it is a
:class:`Trusted` literal built below. ``#SBATCH`` lines are parsed by sbatch, not
by a shell, so their values go through the ``sbatch`` filter, which quotes them the
way sbatch reads them; comment lines take text through the ``comment`` filter.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import jinja2

from jobgen import __version__
from jobgen.durations import format_slurm
from jobgen.exit_codes import ExitCode
from jobgen.loader import ResolvedSpec
from jobgen.paths import PROJECT_ROOT, TEMPLATES_DIR
from jobgen.rundir import RunDir
from jobgen.repro import env_record_patterns

# Programs the launch template can start under torchrun, by spec value.
PROGRAMS = {"train": "trainer", "doctor": "trainer.doctor"}
# What sbatch's #SBATCH parser (src/sbatch/opt.c, get_argument) reads as one argument
# as it stands: no whitespace, quote or backslash, and no '#', which starts a comment there.
_SBATCH_BARE = re.compile(r"^[A-Za-z0-9_.:/@+=,\[\]&|()*!~%^-]+$")
# sbatch reads the script line by line: no quoting carries a newline into an #SBATCH value.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class Trusted(str):
    """Text built by jobgen itself that must reach the script verbatim."""


def _finalize(value: Any) -> str:
    if value is None:
        raise jinja2.UndefinedError("a template printed None; guard optional values with {% if %}")
    if isinstance(value, Trusted):
        return value
    if isinstance(value, bool):
        raise jinja2.UndefinedError("a template printed a boolean; use it in {% if %}")
    return shlex.quote(str(value))


def _sbatch_arg(value: Any) -> Trusted:
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
    return Trusted("'" + str(value).replace("'", "'\"'\"'") + "'")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        finalize=_finalize,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sbatch"] = _sbatch_arg
    env.filters["comment"] = _comment
    env.filters["trusted"] = Trusted
    env.filters["sq"] = _single_quoted
    return env


def script_name(spec: ResolvedSpec) -> str:
    return f"{spec.run.job.program}.sbatch"


def build_context(spec: ResolvedSpec) -> dict[str, Any]:
    """Every value the template needs, derived from the spec in one place."""
    job, site = spec.run.job, spec.site
    slurm, net, py = site.slurm, site.network, site.python
    procs = spec.procs_per_node
    gpus = slurm.gpus_per_node
    gpu_directive = None
    if gpus:
        gpu_directive = (
            f"--gres={slurm.gres_name}:{gpus}" if slurm.gpu_request == "gres" else f"--gpus-per-node={gpus}"
        )
    run_dir = spec.run_dir
    mounts = [f"{spec.runs_root}:{spec.runs_root}", f"{PROJECT_ROOT}:{PROJECT_ROOT}", *py.container_mounts]

    env = dict(site.env)
    if site.paths.hf_home:
        env.setdefault("HF_HOME", site.paths.hf_home)
    env.update(spec.run.env)

    return {
        "jobgen_version": __version__,
        "spec_file": spec.spec_file or "(built in)",
        "site_name": site.name,
        "site_file": spec.site_file,
        "program": job.program,
        "entry_module": PROGRAMS[job.program],
        "job_name": job.name,
        "nodes": job.nodes,
        "procs_per_node": procs,
        "world_size": spec.world_size,
        "cpus_per_task": slurm.cpus_per_node,
        # One OpenMP thread pool per process, splitting the node's CPUs between them.
        "omp_threads": max(1, slurm.cpus_per_node // procs),
        "gpus_per_node": gpus,
        "gpu_directive": gpu_directive,
        "mem": slurm.mem,
        "time": format_slurm(job.time),
        "time_seconds": job.time,
        "exit_grace_seconds": job.exit_grace,
        # On SIGTERM torchrun's agent gives its workers this long to save before SIGKILL
        # (its default, 30 s, cuts saves short): the lead time the spec budgets for a save.
        "shutdown_timeout_seconds": job.exit_grace,
        "failed_marker": str(RunDir(spec.run_dir).failed_marker),
        "done_marker": str(RunDir(spec.run_dir).done_marker),
        "signal": slurm.signal,
        "partition": spec.partition,
        "account": spec.account,
        "qos": spec.qos,
        "constraint": spec.constraint,
        "reservation": slurm.reservation,
        "exclude": ",".join(job.exclude) or None,
        "nodelist": ",".join(job.nodelist) or None,
        "exclusive": slurm.exclusive,
        "hint_nomultithread": slurm.hint_nomultithread,
        "requeue": slurm.requeue,
        "extra_sbatch": slurm.extra_sbatch,
        "array": job.array,
        "run_dir": str(run_dir),
        # --chdir takes the path literally; --output expands %-patterns in all of it.
        "output_pattern": f"{slurm_filename_literal(str(run_dir))}/logs/%x-%j.out",
        "output_per_node": slurm.output_per_node,
        "project_root": str(PROJECT_ROOT),
        "python": py,
        "container_mounts": ",".join(mounts),
        "ifname": net.ifname,
        "transport": net.transport,
        "ib_hca": net.ib_hca,
        "resolve_head_ip": net.resolve_head_ip,
        "rdzv_port": net.rdzv_port,
        "rdzv_port_spread": net.rdzv_port_spread,
        "net_debug": net.debug,
        "net_env": sorted(net.env.items()),
        "env": sorted(env.items()),
        "repro_env": env_record_patterns([*env, *net.env]),
        "exit": {code.name.lower(): int(code) for code in ExitCode},
    }


def render(spec: ResolvedSpec) -> str:
    """The batch script for ``spec`` (train or doctor), as text."""
    return _environment().get_template("torchrun.sbatch.j2").render(**build_context(spec))


def render_all(spec: ResolvedSpec) -> dict[str, str]:
    """File name → text for every script a run directory holds."""
    return {script_name(spec): render(spec)}
