"""jobgen/spec: TODO docstring."""
