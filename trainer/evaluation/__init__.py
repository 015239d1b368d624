"""Evaluation during training: held-out loss, the best checkpoint, early stopping, samples.

``evaluator`` (the held-out loss on every rank, the record of every evaluation, early
stopping), ``in_training`` (what ``[eval]`` adds to the training loop: when an evaluation is
due, the best checkpoint) and ``samples`` (greedy answers to ``[eval] prompts`` a person reads).
"""
