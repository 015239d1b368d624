"""Sweeps: one run.toml with ``[sweep]``, many runs, one Slurm array.

``points`` expands [sweep] into validated run specs, ``render`` writes the array's one script,
``submit`` writes every point's run directory and sweep.json and queues the array, ``claim`` is
what each array task runs first (which point it takes; standard library only), ``status`` shows
one line per point. A sweep's directory and files are read through ``jobgen.runs``.
"""
