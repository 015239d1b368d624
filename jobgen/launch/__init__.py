"""jobgen/launch: TODO docstring."""
