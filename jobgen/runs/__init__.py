"""The run directory and the records in it, as every command and job reads them.

``rundir`` (RunDir: every name in a run directory), ``materialize`` (the run directory assembled
or brought up to date), ``permissions`` (who may write what), ``goodput`` (the JSONL records:
metrics, tasks; lost work and lead time), ``quarantine`` (nodes kept off a run's later tasks),
and a sweep's directory (``sweep_files``: its names and readers; ``sweep_runs``: finding a sweep
and its points).
"""
