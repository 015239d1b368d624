"""jobgen/base: TODO docstring."""
