"""trainer/data: TODO docstring."""
