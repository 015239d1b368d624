"""jobgen/plan: TODO docstring."""
