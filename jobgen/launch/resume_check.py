"""A resubmitted run's checkpoint against the spec it is resubmitted with, at submit: the
next task would refuse a checkpoint trained with another global batch (jobgen.spec.global_batch)
after its queue wait; submit says so first. Apart from global_batch.py, which the loader
uses, because it reads the run directory."""

from __future__ import annotations

import json
from pathlib import Path

from jobgen.runs.rundir import complete_checkpoints_in
from jobgen.spec.global_batch import BatchShape, GlobalBatchChanged, shape_for
from jobgen.spec.tables.train import TrainSpec


def checkpoint_shape(run_dir: Path) -> tuple[str, BatchShape] | None:
    """The newest complete checkpoint of the bundled trainer and the batch it was trained
    with (its trainer_state.json), or None (no checkpoint, or one from before shapes)."""
    checkpoints = complete_checkpoints_in(Path(run_dir) / "checkpoints")
    if not checkpoints:
        return None
    _, path = checkpoints[-1]
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None  # the trainer's resume decides what an unreadable checkpoint means
    shape = BatchShape.from_json(state.get("batch") if isinstance(state, dict) else None)
    return (path.name, shape) if shape is not None else None


def resume_problem(train: TrainSpec, world_sizes: list[int], run_dir: Path) -> str | None:
    """Why the next task would refuse the run's checkpoint, found at submit rather than
    after the queue wait: a world size whose global batch is not the checkpoint's."""
    found = checkpoint_shape(run_dir)
    if found is None or train.allow_batch_change:
        return None
    name, saved = found
    for world in world_sizes:
        now = shape_for(train, world)
        if now.global_batch != saved.global_batch:
            return str(GlobalBatchChanged(saved, now)).replace("the checkpoint", f"the checkpoint {name}", 1)
    return None
