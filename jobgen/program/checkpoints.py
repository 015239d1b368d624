"""The newest complete checkpoint a user's program left in the run's checkpoint directory:
what ``{latest_checkpoint}`` names and what ``[command] hf_trainer`` resumes from.

The rule is ``[command] checkpoints``, a glob over the names in the checkpoint directory:

- ``checkpoint-*`` (the default): the Hugging Face Trainer's ``checkpoint-N`` directories.
  Complete means ``trainer_state.json``, which the Trainer writes last, reads back with
  ``global_step`` N; a directory a kill cut short is skipped, the next older one is taken.
- any other glob (``step-*``, ``*.pt``, ``ckpt_*``): the newest match by the number in its
  name (the last run of digits: ``step-00000120`` is 120, ``epoch2-step500`` 500); names
  without a number rank below those with one, newest by modification time. Names starting
  with a dot (a save in progress, by the usual convention) never match.

Torch- and transformers-free: the batch script decides this on the head node before any
rank starts (:mod:`jobgen.launch.command_plan`), and :mod:`jobgen.runtime.hf` uses it too.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from pathlib import Path

from jobgen.program.trainer_records import TRAINER_CHECKPOINT, trainer_state

log = logging.getLogger("jobgen.runtime")

HF_CHECKPOINTS = "checkpoint-*"
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


def newest_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The newest Hugging Face ``checkpoint-N`` whose ``trainer_state.json`` reads back with
    ``global_step`` N; a checkpoint cut short by a kill is skipped."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return None
    found = sorted(
        ((int(m.group(1)), p) for p in directory.iterdir() if (m := TRAINER_CHECKPOINT.match(p.name)) and p.is_dir()),
        reverse=True,
    )
    for step, path in found:
        state = trainer_state(path)
        if state is None:
            log.warning("jobgen: %s is incomplete (no readable trainer_state.json): skipped", path)
            continue
        held = state.get("global_step")
        if held == step:
            return str(path)
        log.warning("jobgen: %s holds global_step %s: skipped", path, held)
    return None


def _rank(path: Path) -> tuple[int, int, float]:
    """Sort key, larger is newer: (has a number, the number, modification time)."""
    match = _LAST_NUMBER.search(path.name)
    try:
        mtime = path.stat().st_mtime
    except OSError:  # removed meanwhile (a program pruning its old checkpoints)
        mtime = -1.0
    return (1, int(match.group(1)), mtime) if match else (0, 0, mtime)


def newest_matching(directory: str | Path, pattern: str) -> str | None:
    """The newest entry of ``directory`` whose name matches the glob ``pattern`` (see the
    module docstring for the order), or None."""
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    matches = [
        directory / name
        for name in names
        if fnmatch.fnmatchcase(name, pattern) and (pattern.startswith(".") or not name.startswith("."))
    ]
    ranked = [(key, path) for path in matches if (key := _rank(path))[2] >= 0]
    return str(max(ranked)[1]) if ranked else None


def latest_checkpoint(directory: str | Path, rule: str) -> str | None:
    """What ``{latest_checkpoint}`` is for ``rule`` (``[command] checkpoints``) in ``directory``."""
    if rule == HF_CHECKPOINTS:
        return newest_complete_checkpoint(directory)
    return newest_matching(directory, rule)
