"""The parallelisms as the trainer runs them, one table: ``strategies``.

``strategies`` (DDP, FSDP2, HSDP, pipeline: how each wraps a model, syncs, reduces the grad norm),
``step_runner`` (one optimizer step of the data-parallel strategies), ``pipeline`` and
``pipeline_steps`` (pipeline parallelism), ``context_parallel`` and ``context_parallel_layout``
(sequences split across ranks); ``build`` (the model ready to train, as the table builds and wraps it:
the trainer's one call) and ``step_parts`` (what the Trainer hands the step runners and its evaluator).
"""
