"""jobgen/runs: TODO docstring."""
