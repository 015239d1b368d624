"""A model and how it is laid out across ranks, known before anything runs and without torch.

``files`` reads a model directory (safetensors headers, config.json) and ``traits`` what in it
decides whether a parallelism can train it; ``lora_targets`` works out
which layers ``[model.lora] target_modules`` adapts; ``pipeline_split`` which decoder blocks each
pipeline stage holds; ``parallelism`` is the one table of parallelisms (what each shards, the
settings it refuses, what the planner may change), keyed as the trainer's table
(trainer/parallel/strategies.py) is; ``mesh`` the one layout of a world by its degrees
(pipeline, replicate, shard, context parallel) that the spec, the plan and the trainer read.
"""
