"""jobgen: one run.toml in, multi-node sbatch scripts out, submitted to Slurm.

Importing this package must stay cheap: the CLI never imports torch,
transformers or datasets (see tests/unit/test_cli.py::test_cli_imports_no_ml_libraries).
"""

__version__ = "0.1.0"
