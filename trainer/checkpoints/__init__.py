"""Checkpoints: saved sharded, read without running anything they hold, exported.

``checkpointer`` (the Checkpointer: when to save, DCP writes that are never half-complete,
resume from the newest that loads), ``reader`` (DCP metadata and shards through a restricted
unpickler), ``export`` (``jobgen export``: a checkpoint consolidated into a Hugging Face model
directory) and ``hf_shards`` (the safetensors shards written tensor by tensor).
"""
