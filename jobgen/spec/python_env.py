"""The job's Python environment when the site leaves it to jobgen (``python.kind = "auto"``):
the environment that runs ``jobgen submit``, found from its interpreter's prefix.

A venv (``pyvenv.cfg``) is activated as a venv, a conda environment (``conda-meta/``) with
``conda activate`` from its installation, anything else (a plain installation, a module's
Python) by putting its ``bin/`` first on PATH. What it resolves to is written into the run's
spec.json as that kind, so a queued task activates what submitted it, whichever shell or
environment later looks at the run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from jobgen.spec.tables.site import PythonSettings


def conda_base_of(prefix: Path, conda_exe: str | None) -> Path | None:
    """The conda installation an environment belongs to: the one running conda names
    ($CONDA_EXE is <base>/bin/conda), else <base>/envs/<name> read backwards, else the
    prefix itself when it is a base installation (it holds etc/profile.d/conda.sh)."""
    if conda_exe:
        base = Path(conda_exe).parent.parent
        if (base / "etc" / "profile.d" / "conda.sh").is_file():
            return base
    if prefix.parent.name == "envs" and (prefix.parent.parent / "etc" / "profile.d" / "conda.sh").is_file():
        return prefix.parent.parent
    if (prefix / "etc" / "profile.d" / "conda.sh").is_file():
        return prefix
    return None


def resolve_python(python: PythonSettings, prefix: str | None = None) -> PythonSettings:
    """``python`` itself unless its kind is "auto"; then the settings of the environment at
    ``prefix`` (this interpreter's, ``sys.prefix``, by default), keeping its modules. A container
    site's ``host_python``, unless given, is that environment's Python."""
    root = Path(prefix or sys.prefix)
    if python.kind == "container" and not python.host_python:
        # The supervisor runs on the batch host, outside the image: with this environment's Python.
        interpreter = root / "bin" / "python3"
        return python.model_copy(update={"host_python": str(interpreter if interpreter.exists() else sys.executable)})
    if python.kind != "auto":
        return python
    keep = {"modules": list(python.modules), "container_mounts": list(python.container_mounts)}
    if (root / "pyvenv.cfg").is_file():
        return PythonSettings(kind="venv", venv=str(root), **keep)
    if (root / "conda-meta").is_dir():
        base = conda_base_of(root, os.environ.get("CONDA_EXE"))
        return PythonSettings(kind="conda", conda_env=str(root), conda_base=str(base) if base else None, **keep)
    return PythonSettings(kind="prefix", prefix=str(root), **keep)
