"""The ground floor: what every room uses and nothing of jobgen's.

Write-to-temp-then-rename (``atomic``), files read as untrusted input (``safe_read``: one typed
reader per kind, DamagedFile naming the file), directories in places others can write held as
the user's own through one checked descriptor (``owned_dir``), text made safe for a terminal (``visible``), the
one-writer lock (``lease``), durations and sizes as people write them, the exit codes the scripts
and programs agree on, progress lines, and where the bundled files live (``paths``). Standard
library only: a sweep's claim runs on it under ``python -I -S``.
"""
