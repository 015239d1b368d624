"""jobgen/cli: TODO docstring."""
