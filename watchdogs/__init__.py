"""Watchdogs: scheduled checks that run as small Slurm jobs and alert a person before a run dies.

    jobgen watchdog install RUN          # job files + self-resubmitting scheduler chains
    jobgen watchdog run disk RUN         # one check by hand; exit 1 when it alerts
    python -m watchdogs.disk --path /scratch --min-free 20%

Checks: ``disk`` (bytes, inodes, checkpoint forecast), ``running`` (queued or
running unless finished), ``hang`` (no progress while RUNNING; py-spy stacks of
every rank), ``memory`` (node memory). Nothing here imports torch.
"""

CHECKS = ("disk", "running", "hang", "memory")
