"""The run directory and the records in it, as every command and job reads them.

``rundir`` (RunDir: every name in a run directory), ``materialize`` (the run directory assembled
or brought up to date), ``permissions`` (who may write what), ``jsonl_records`` (the JSONL
records, metrics and tasks, each line checked as it is read), ``metrics_summary`` and
``summary_cache`` (what the read-side commands need of metrics.jsonl, kept beside it so that
reading a run costs the same after a week as after a minute), ``goodput`` (lost work and lead
time), ``quarantine`` (nodes kept off a run's later tasks),
and a sweep's directory (``sweep_files``: its names and readers; ``sweep_runs``: finding a sweep
and its points).
"""
