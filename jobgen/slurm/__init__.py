"""jobgen/slurm: TODO docstring."""
