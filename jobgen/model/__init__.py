"""A model and how it is laid out across ranks, known before anything runs and without torch.

``files`` reads a model directory (safetensors headers, config.json); ``lora_targets`` works out
which layers ``[model.lora] target_modules`` adapts; ``pipeline_split`` which decoder blocks each
pipeline stage holds; ``parallelism`` is the one table of data-parallel strategies (what each
shards, its refused keys, its planner figures), keyed as the trainer's table
(trainer/parallel/strategies.py) is.
"""
