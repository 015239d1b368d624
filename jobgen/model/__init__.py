"""jobgen/model: TODO docstring."""
