"""jobgen/report: TODO docstring."""
