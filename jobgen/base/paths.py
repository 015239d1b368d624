"""Where the files jobgen ships live, and where the user's own site profiles are.

The sbatch templates, the bundled site profiles and the examples are package data
(``jobgen/bundled/``), found through importlib.resources: the same from a checkout, a
wheel or a ``pip install git+URL``, from any working directory. Nothing is found by
walking up from the source tree.

``SOURCE_ROOT`` is the directory that holds the ``jobgen``, ``trainer`` and ``watchdogs``
packages: a checkout (``pip install -e .``) or a site-packages directory. Only a checkout
is put on the nodes' PYTHONPATH and recorded by its git state (``CHECKOUT``); an installed
jobgen is found by the environment the job activates.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path


def _bundled() -> Path:
    # pip installs a wheel unpacked, so the package's resources are plain files; a zipped
    # jobgen (zipimport) would give a Traversable that is not a path, and the templates and
    # profiles could not be handed to Jinja or globbed.
    root = files("jobgen").joinpath("bundled")
    path = Path(os.fspath(root))  # type: ignore[arg-type]
    if not path.is_dir():
        raise RuntimeError(f"jobgen's package data is missing: {path} (reinstall jobgen from a wheel or a checkout)")
    return path


BUNDLED_DIR = _bundled()
TEMPLATES_DIR = BUNDLED_DIR / "sbatch_templates"
SITE_CONFIGS_DIR = BUNDLED_DIR / "site_configs"
EXAMPLES_DIR = BUNDLED_DIR / "examples"
CONTAINERFILE = BUNDLED_DIR / "container" / "Containerfile"

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # <root>/jobgen/base/paths.py


def _checkout(root: Path) -> Path | None:
    """The source checkout jobgen runs from, or None when it is installed (site-packages
    holds no pyproject.toml of jobgen's)."""
    project = root / "pyproject.toml"
    try:
        return root if 'name = "jobgen"' in project.read_text(errors="replace") else None
    except OSError:
        return None


CHECKOUT = _checkout(SOURCE_ROOT)


def user_config_dir() -> Path:
    """``$XDG_CONFIG_HOME/jobgen`` (default ``~/.config/jobgen``): the user's own site profiles
    (``sites/``), searched before the bundled ones."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "jobgen"
