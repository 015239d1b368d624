"""What a program jobgen did not write leaves in the run directory, read without importing it.

A Hugging Face ``Trainer`` run as ``program = "command"`` (with ``hf_trainer``, the
placeholders, or unchanged) saves ``checkpoint-<step>/`` directories under the run's
checkpoint directory and writes ``trainer_state.json`` into each one last: its
``global_step`` and its ``log_history`` (every logged loss and learning rate since step 0)
are the Trainer's own record of its progress. ``jobgen status`` counts such a checkpoint
as saved; ``jobgen plot`` draws the history when the program left no ``metrics.jsonl``
lines of its own (no ``JobgenCallback``).

The names here are the Trainer's, not jobgen's (:mod:`jobgen.runs.rundir` spells jobgen's own);
:mod:`jobgen.runtime.hf` reads the same ones to resume, but imports transformers, which the
CLI never does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from jobgen.base.safe_read import DamagedFile, is_int, is_number, read_object

# The Trainer's checkpoint directories: transformers.trainer_utils.PREFIX_CHECKPOINT_DIR + "-<step>".
TRAINER_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"


def trainer_state(path: Path) -> dict[str, Any] | None:
    """A Trainer checkpoint's ``trainer_state.json``, or None if it is missing or no such state
    (a link, cut, edited: jobgen.base.safe_read); the checkpoint is then no complete one."""
    try:
        return read_object(path / TRAINER_STATE, "a Trainer's state")
    except (FileNotFoundError, DamagedFile):
        return None


def trainer_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete Trainer checkpoint under ``directory``, oldest first:
    one whose ``trainer_state.json`` (written last) reads back with its own step. A checkpoint
    cut short by a kill has none, or an unreadable one, and is left out."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = TRAINER_CHECKPOINT.match(path.name)
        if match and path.is_dir():
            state = trainer_state(path)
            if state is not None and is_int(state.get("global_step")) and state["global_step"] == int(match.group(1)):
                found.append((int(match.group(1)), path))
    return sorted(found)


def _number(value: Any) -> bool:
    # A bool is no loss; an int of 400 digits is no float (jobgen.base.safe_read.is_number).
    return is_number(value)


def trainer_history(directory: Path, time: float | None = None) -> list[dict[str, Any]]:
    """The newest complete Trainer checkpoint's ``log_history`` as ``metrics.jsonl`` lines:
    ``step``, ``loss``, ``lr``, ``grad_norm`` (the training lines only; evaluations as
    ``eval_loss`` lines with ``event = "eval"``). The Trainer records no wall time per line:
    every line gets ``time`` (the checkpoint's), so a plot against time shows them at the save."""
    saved = trainer_checkpoints(directory)
    if not saved:
        return []
    path = saved[-1][1]
    state = trainer_state(path) or {}
    stamp = time if time is not None else (path / TRAINER_STATE).stat().st_mtime
    lines = []
    history = state.get("log_history")
    for entry in history if isinstance(history, list) else []:
        if not isinstance(entry, dict) or not is_int(entry.get("step")):
            continue
        line: dict[str, Any] = {"time": stamp, "step": entry["step"], "job_id": "trainer_state", "restart": 0}
        for theirs, ours in (("loss", "loss"), ("learning_rate", "lr"), ("grad_norm", "grad_norm")):
            if _number(entry.get(theirs)):
                line[ours] = float(entry[theirs])
        if _number(entry.get("eval_loss")):
            line.update(event="eval", eval_loss=float(entry["eval_loss"]))
        if len(line) > 4:
            lines.append(line)
    return lines
