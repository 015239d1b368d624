"""The programs a run can be (``job.program``), and your own program (``"command"``) as jobgen
knows it without importing it.

``kinds`` is the one table of programs (train, doctor, command): what the spec checks, the batch
script, preflight and status need of each, read from its entry and never from its name. Then,
for your own program: the placeholders of ``[command] args`` and ``[env]`` (``placeholders``),
the rules that find the newest complete checkpoint it left (``checkpoints``), and what a Hugging
Face Trainer writes into the run directory (``trainer_records``).
"""
