"""What a person asks of runs: their status, logs, plots, samples and comparisons.

``status`` decides a run's state on ``status_facts`` (the records and Slurm's answers gathered
first) and ``task_table`` (its array tasks); ``status_format`` prints it; ``stop_requests`` clears
requests of ended attempts; ``logs``, ``plot``, ``samples``, ``compare`` and ``first_step``
(``submit --wait``) are the other commands' bodies.
"""
