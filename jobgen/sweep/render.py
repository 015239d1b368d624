"""A sweep's one batch script: pure (sweep) -> text, as :mod:`jobgen.launch.render` is for a run.

Every point shares the allocation (jobgen.sweep.points.allocation checks it), so the sweep's
``#SBATCH`` lines are the base run's, with the sweep's own name, directory and log. The body
(``sbatch_templates/sweep.sbatch.j2``) claims a point and runs that point's own script,
rendered by :func:`jobgen.launch.render.render` from the point's spec like any run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobgen import __version__
from jobgen.launch.render import (
    Trusted,
    exported_names,
    python_context,
    sbatch_arg,
    slurm_filename_literal,
    template_environment,
)
from jobgen.runs.sweep_files import LOGS_DIR, POINTS_DIR, SWEEP_SCRIPT
from jobgen.sweep.claim import HOLDING_STATES
from jobgen.sweep.points import Sweep, allocation

# A task that finds every open point held by a task Slurm is still ending waits this long
# for one (KillWait is 30 s by default; the claim is asked again every 5 s).
CLAIM_WAIT_SECONDS = 180


def sweep_log(directory: Path) -> Path:
    """The sweep script's own output (%x: the sweep's name, %A_%a: array job and task)."""
    return directory / LOGS_DIR / "%x-%A_%a.out"


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


def sweep_context(sweep: Sweep) -> dict[str, Any]:
    return {
        "jobgen_version": __version__,
        "spec_file": sweep.base.spec_file or "(built in)",
        "site_name": sweep.base.site.name,
        "sweep_name": sweep.name,
        "sweep_dir": str(sweep.directory),
        "points_dir": str(sweep.directory / POINTS_DIR),
        "script_name": SWEEP_SCRIPT,
        "max_parallel": sweep.settings.max_parallel,
        "point_count": len(sweep.points),
        "points": [p.name for p in sweep.points],
        "sbatch_directives": sweep_directives(sweep),
        # squeue's states of a task that still holds its point: it runs or is ending.
        "holding_states": ",".join(sorted(HOLDING_STATES)),
        "claim_wait_seconds": CLAIM_WAIT_SECONDS,
        # The job's Python (_python_env.j2), as the base run's script has it: the claim runs there.
        **python_context(sweep.base, exported_names(sweep.base)),
    }


def render_sweep(sweep: Sweep) -> str:
    """The sweep's batch script, as text."""
    return template_environment().get_template("sweep.sbatch.j2").render(**sweep_context(sweep))
