"""Errors of the model the trainer is given, below every module that raises or catches them
(trainer.model.build refuses a model with them, trainer.model.sharded_load raises them too)."""

from __future__ import annotations


class ModelError(ValueError):
    """The model or tokenizer at ``model.path`` cannot be trained as it is; the message says what to change."""
