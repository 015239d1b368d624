"""A sweep's one batch script: pure (sweep) -> text, as :mod:`jobgen.render` is for a run.

Every point shares the allocation (jobgen.sweep_points.allocation checks it), so the sweep's
``#SBATCH`` lines are the base run's, with the sweep's own name, directory and log. The body
(``sbatch_templates/sweep.sbatch.j2``) claims a point and runs that point's own script,
rendered by :func:`jobgen.render.render` from the point's spec like any run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobgen import __version__
from jobgen.paths import PROJECT_ROOT
from jobgen.render import Trusted, sbatch_arg, slurm_filename_literal, template_environment
from jobgen.sweep_points import Sweep, allocation

SWEEP_SCRIPT = "sweep.sbatch"


def sweep_log(directory: Path) -> Path:
    """The sweep script's own output (%x: the sweep's name, %A_%a: array job and task)."""
    return directory / "logs" / "%x-%A_%a.out"


def sweep_directives(sweep: Sweep) -> list[Trusted]:
    """The base run's directives, with the sweep's name, directory and log."""
    shared = [Trusted(d) for d in allocation(sweep.base)]  # the directives every point shares
    log = sweep_log(sweep.directory).relative_to(sweep.directory)
    own = [
        Trusted(f"--job-name={sbatch_arg(sweep.name)}"),
        Trusted(f"--chdir={sbatch_arg(sweep.directory)}"),
        Trusted(f"--output={sbatch_arg(f'{slurm_filename_literal(str(sweep.directory))}/{log}')}"),
        Trusted("--open-mode=append"),
    ]
    return own + shared


def python_activate(sweep: Sweep) -> str | None:
    """The script that puts the job's Python on PATH before the claim, when the site names one.
    A container site claims with the node's python3: the claim needs the standard library only."""
    py = sweep.base.site.python
    if py.kind == "venv" and py.venv:
        return f"{py.venv}/bin/activate"
    if py.kind == "modules" and py.module_venv:
        return f"{py.module_venv}/bin/activate"
    return None


def sweep_context(sweep: Sweep) -> dict[str, Any]:
    return {
        "jobgen_version": __version__,
        "spec_file": sweep.base.spec_file or "(built in)",
        "site_name": sweep.base.site.name,
        "sweep_name": sweep.name,
        "sweep_dir": str(sweep.directory),
        "script_name": SWEEP_SCRIPT,
        "max_parallel": sweep.settings.max_parallel,
        "point_count": len(sweep.points),
        "points": [p.name for p in sweep.points],
        "sbatch_directives": sweep_directives(sweep),
        "python_activate": python_activate(sweep),
        "project_root": str(PROJECT_ROOT),
    }


def render_sweep(sweep: Sweep) -> str:
    """The sweep's batch script, as text."""
    return template_environment().get_template("sweep.sbatch.j2").render(**sweep_context(sweep))
