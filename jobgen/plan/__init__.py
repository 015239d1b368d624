"""``jobgen plan``: one rank's memory, estimated from the model's shapes before anything runs.

``inputs`` (what of the spec the plan reads), ``estimate`` (the components and phases of a
rank's peak), ``nccl`` (communicator buffers),
``pipeline`` and ``context_parallel`` (what those parallelisms change), ``memory_plan`` (the
plan and its verdict, what submit checks) and ``suggestions`` (the cheapest changes that fit).
"""
