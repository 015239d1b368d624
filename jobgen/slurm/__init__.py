"""Slurm: the one place jobgen runs sbatch, squeue, scontrol, scancel and sacct.

``client`` runs the commands, with the one table of job states, node states and pending reasons;
``text`` holds the pure parsers of their output (unit-tested on captured text). Every room that
needs Slurm's answer asks ``client``, the job's supervisor (jobgen.job) included; only the batch
script's own shell lines before it (srun of the start probe and the launch) run Slurm's commands
themselves.
"""
