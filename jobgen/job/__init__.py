"""The job's supervisor: the Python process on a task's batch host that owns the task from the
program's first launch to its end (launch and relaunch, the hang watch, the choice of nodes,
the program's exit, the signals, the run's markers, the task's record and comment, clean-up).
The rendered batch script keeps the directives, the environment and the launch line, and hands
over to it: ``exec python -m jobgen.job --settings JSON``.

- :mod:`jobgen.job.decisions`: every decision, a function of plain facts (table-tested).
- :mod:`jobgen.job.supervisor`: the loop that gathers the facts and acts on them.
- :mod:`jobgen.job.effects`: what it does to Slurm and the nodes (one interface, local or Slurm).
- :mod:`jobgen.job.hang_watch`: the heartbeats of one launch.
- :mod:`jobgen.job.records`: what it writes into the run directory.
- :mod:`jobgen.job.settings`: what the script tells it, and the task as Slurm's environment names it.
"""
