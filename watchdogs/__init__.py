"""Scheduled checks that run as Slurm jobs and alert a person before a run dies."""
