"""From a resolved spec to a queued job: render, check, submit.

``render`` (pure: spec → batch script, #SBATCH directives built as data), ``preflight`` (the
checks against the live cluster), ``resume_check`` (a resubmission against its checkpoint),
``submission`` (the submission core a run, a sweep and a served model share: checks, preflight,
files written, queued, rolled back on failure), ``executors`` (where the job runs: Slurm, or
``--local`` on this machine), ``submit`` (a run's submission), ``repro`` (what a job records of
its environment), ``command_plan`` (a command task's one decision, written on the head node) and
``doctor`` (the node health job).
"""
