"""From a resolved spec to a queued job: render, check, submit.

``render`` (pure: spec → batch script, #SBATCH directives built as data), ``preflight`` (the
checks against the live cluster), ``resume_check`` (a resubmission against its checkpoint),
``submit`` (the submission core: checks, run directory, sbatch, roll back; ``--local`` runs the
same script here), ``repro`` (what a job records of its environment), ``command_plan`` (a command
task's one decision, written on the head node) and ``doctor`` (the node health job).
"""
