"""trainer/parallel: TODO docstring."""
