"""jobgen/spec/tables: TODO docstring."""
