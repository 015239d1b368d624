"""jobgen/sweep: TODO docstring."""
