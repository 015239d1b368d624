"""jobgen/serve: TODO docstring."""
