"""The trainer's data pipeline: rows to tokenized examples to packed micro-batches.

``source`` reads the rows of [data] path (each source of a mixture alike), ``formats`` turns
each row into segments with a loss role, ``build`` tokenizes (``build_dataset``, its one
entry), ``cache`` keeps the result shared on disk, ``stats`` records what preprocessing did,
``packing`` packs and collates, ``sampler`` orders rows per rank (and draws a mixture's
sources by share) so a resumed run sees what it had not seen, ``eval_set`` is the evaluation
set, and ``batches`` ties them together: ``training_data``, the trainer's one call, returns the
run's data on this rank as one ``DataPipeline``.
"""
