"""jobgen/program: TODO docstring."""
