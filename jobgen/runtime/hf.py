"""jobgen's lifecycle for a Hugging Face ``Trainer`` (needs transformers; ``jobgen.runtime``
itself does not)::

    from jobgen.runtime.hf import JobgenCallback, resume_checkpoint

    args = TrainingArguments(output_dir=str(runtime.current().checkpoint_dir), ...)
    trainer = Trainer(model=model, args=args, ..., callbacks=[JobgenCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))

At every step end all ranks agree (one all-reduce) on what the switches, Slurm's lead-time
signal, SIGTERM, the deadline and the memory guard ask for: the Trainer saves a checkpoint
and stops, saves and goes on (save switch), or stops at once (abort switch). The next array
task resumes from the newest complete ``checkpoint-N`` with no step computed twice. The
steps, the loss and the exit reason reach ``jobgen status``, goodput and the watchdogs.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

from transformers import TrainerCallback

from jobgen.runtime import Job, Life, NotUnderJobgen, current

log = logging.getLogger("jobgen.runtime")

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class JobgenCallback(TrainerCallback):
    """Saves and stops the Trainer when jobgen's lifecycle says so, and keeps the run's records."""

    def __init__(self, job: Job | None = None):
        self.job = job or current()
        if self.job is None:
            raise NotUnderJobgen("JobgenCallback needs the JOBGEN_RUN_DIR a jobgen batch script sets")
        self.life: Life | None = None
        self._metrics: dict[str, float] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.job.install_signal_handlers()
        self.life = Life(self.job, start_step=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # The Trainer logs after on_step_end: the values go with the next step's record.
        for key in ("loss", "learning_rate", "grad_norm"):
            if logs and isinstance(logs.get(key), (int, float)):
                self._metrics["lr" if key == "learning_rate" else key] = float(logs[key])

    def on_step_end(self, args, state, control, **kwargs):
        action = self.life.step_done(state.global_step, **self._metrics)
        if action.saves:
            control.should_save = True
        if action.exits:
            control.should_training_stop = True
            if self.job.is_main:
                log.warning("jobgen: %s (step %d)", self.job.describe(action), state.global_step)
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.life is not None:
            self.life.saved()

    def on_train_end(self, args, state, control, **kwargs):
        if self.life is not None:
            self.life.finish(*self.life.outcome())


def newest_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The newest ``checkpoint-N`` whose ``trainer_state.json`` (the Trainer writes it last)
    reads back with ``global_step`` N; a checkpoint cut short by a kill is skipped."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return None
    found = sorted(
        ((int(m.group(1)), p) for p in directory.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()),
        reverse=True,
    )
    for step, path in found:
        try:
            state = json.loads((path / "trainer_state.json").read_text())
        except (OSError, ValueError):
            log.warning("jobgen: %s is incomplete (no readable trainer_state.json): skipped", path)
            continue
        if state.get("global_step") == step:
            return str(path)
        log.warning("jobgen: %s holds global_step %s: skipped", path, state.get("global_step"))
    return None


def resume_checkpoint(output_dir: str | Path) -> str | None:
    """What to pass to ``trainer.train(resume_from_checkpoint=...)``: the newest complete
    checkpoint, or None for a fresh start. Decided once, by rank 0, and broadcast when
    torch.distributed is up (a directory listing is never taken on every rank)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return newest_complete_checkpoint(output_dir)
    box = [newest_complete_checkpoint(output_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
