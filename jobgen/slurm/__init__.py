"""Slurm: the one place jobgen runs sbatch, squeue, scontrol, scancel and sacct.

``client`` runs the commands, with the one table of job states, node states and pending reasons;
``text`` holds the pure parsers of their output (unit-tested on captured text). Every room that
needs Slurm's answer asks ``client``; nothing else runs a Slurm command (a batch script asks
squeue on its node itself, as the script's own shell logic).
"""
