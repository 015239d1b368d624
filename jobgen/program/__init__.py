"""Your own program (``job.program = "command"``) as jobgen knows it without importing it.

The placeholders of ``[command] args`` and ``[env]`` (``placeholders``), the rules that find the
newest complete checkpoint your program left (``checkpoints``), and what a Hugging Face Trainer
writes into the run directory (``trainer_records``).
"""
