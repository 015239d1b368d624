"""Where the bundled templates, site profiles and trainer live.

jobgen is installed from a checkout (``pip install -e .``): the compute nodes run
the trainer from the same tree, and the rendered script records its git state.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # jobgen/base/paths.py
TEMPLATES_DIR = PROJECT_ROOT / "sbatch_templates"
SITE_CONFIGS_DIR = PROJECT_ROOT / "site_configs"
EXAMPLES_DIR = PROJECT_ROOT / "examples"
