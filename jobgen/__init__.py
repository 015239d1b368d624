"""jobgen: one run.toml in, multi-node sbatch scripts out, submitted to Slurm.

Importing this package must stay cheap: the CLI never imports torch,
transformers or datasets (see tests/unit/test_cli.py::test_cli_imports_no_ml_libraries).

The code lives in rooms, one concern each (docs/architecture.md, generated from their
docstrings): :data:`ROOMS` says which room may import which, lowest first
(tests/unit/test_layering.py holds every import to it).
"""

from __future__ import annotations

import sys

__version__ = "0.1.0"

# Each room and the rooms it may import besides itself: a DAG, lowest first. cli is the
# composition root ("*": every room, and trainer/ and watchdogs/ too).
ROOMS: dict[str, tuple[str, ...]] = {
    "base": (),
    "slurm": ("base",),
    "model": ("base",),
    "program": ("base",),
    "spec": ("base", "model", "program"),
    "sites": ("base", "slurm", "spec"),
    "plan": ("base", "model", "spec"),
    "runs": ("base", "slurm", "model", "program", "spec"),
    "job": ("base", "slurm", "spec", "runs"),
    "launch": ("base", "slurm", "model", "program", "spec", "plan", "runs", "job"),
    "runtime": ("base", "slurm", "program", "spec", "runs", "launch"),
    "report": ("base", "slurm", "model", "program", "spec", "plan", "runs", "launch", "runtime"),
    "sweep": ("base", "slurm", "program", "spec", "runs", "launch", "report"),
    "serve": ("base", "slurm", "model", "program", "spec", "runs", "launch", "report"),
    "devcluster": ("base", "slurm"),
    "cli": ("*",),
}

# What batch scripts rendered before the rooms run as ``python -m jobgen.X``. Slurm keeps a
# script as it was submitted: an array task queued last week runs it after jobgen was upgraded,
# and must still find its entry point (tests/unit/test_layering.py checks every one).
MOVED_ENTRY_POINTS: dict[str, str] = {
    "jobgen.sweep_claim": "jobgen.sweep.claim",
    "jobgen.command_plan": "jobgen.launch.command_plan",
    "jobgen.quarantine": "jobgen.runs.quarantine",
    "jobgen.repro": "jobgen.launch.repro",
    "jobgen.serve_node": "jobgen.serve.node",
    "jobgen.serve_uds": "jobgen.serve.uds",
}


class _MovedEntryPoints:
    """Finds an entry point of :data:`MOVED_ENTRY_POINTS` under its old name: the new module's
    code, loaded under the name it was asked by (``python -m`` runs it as ``__main__``). A meta
    path finder by its one method (importlib.abc would cost the CLI's start tens of ms)."""

    def find_spec(self, name, path=None, target=None):
        moved = MOVED_ENTRY_POINTS.get(name)
        if moved is None:
            return None
        import importlib.util

        found = importlib.util.find_spec(moved)
        return None if found is None else importlib.util.spec_from_file_location(name, found.origin)


if not any(isinstance(finder, _MovedEntryPoints) for finder in sys.meta_path):
    sys.meta_path.append(_MovedEntryPoints())
