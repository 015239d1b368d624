"""The model a rank trains: loaded, made ready, sharded, and what goes wrong with it.

``build`` (the whole model loaded, LoRA, checkpointing, and what is refused before any load;
trainer.parallel.build, above the parallelisms, is the trainer's one call that wraps it),
``prep`` (a bare Hugging Face model made ready to train, and the lookups every strategy shares),
``sharded_load`` (a model larger than one device: built on meta, sharded, each rank reading
only its slices of the safetensors) and ``errors`` (the model's typed errors, below them all).
"""
