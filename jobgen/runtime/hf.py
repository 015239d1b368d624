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

A script nobody edited gets the same with ``[command] hf_trainer = true``: jobgen's launcher
(:mod:`jobgen.runtime.launch`) calls :func:`patch_trainer` before it runs the script, and a
planned stop then ends the process right after the checkpoint (:class:`PlannedStop`).
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

from transformers import Trainer, TrainerCallback

from jobgen.base.exit_codes import ExitCode
from jobgen.program.checkpoints import newest_complete_checkpoint
from jobgen.runtime import Job, Life, NotUnderJobgen, current

__all__ = [
    "JobgenCallback",
    "OutputDirMismatch",
    "PlannedStop",
    "newest_complete_checkpoint",
    "patch_trainer",
    "resume_checkpoint",
]

log = logging.getLogger("jobgen.runtime")


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


# ----------------------------------------------------------- an unedited script ([command] hf_trainer)


class PlannedStop(SystemExit):
    """The Trainer saved and stopped for a planned reason (time limit, SIGTERM, deadline, kill
    switch, memory guard; or the abort switch, without a save): the process ends now, with
    that exit code, before the script's own code after ``train()`` runs. A SystemExit, so
    that a script's ``except Exception`` cannot swallow it and go on to save a "final" model."""

    def __init__(self, code: ExitCode, reason: str):
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason


class OutputDirMismatch(RuntimeError):
    """A Trainer whose output_dir is not the run's checkpoint directory: jobgen would resume
    from, and the next task look for, checkpoints in a place the Trainer never writes."""


def patch_trainer(checkpoint_dir: str | Path, checkpoint: str | None, job: Job | None = None) -> None:
    """Make every ``transformers.Trainer`` the program builds (subclasses too) run under jobgen:
    one :class:`JobgenCallback`, output_dir checked against ``checkpoint_dir``, ``train()``
    resumed from ``checkpoint`` (the task's plan: one decision for all ranks) when the caller
    names none, and :class:`PlannedStop` raised when the callback stopped training."""
    if getattr(Trainer, "_jobgen_patched", False):
        return
    original_init, original_train = Trainer.__init__, Trainer.train
    shared: list[Job] = [job] if job is not None else []

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        check_output_dir(self.args.output_dir, checkpoint_dir)
        if _jobgen_callback(self) is None:
            if not shared:
                shared.append(_current_job())
            self.add_callback(JobgenCallback(shared[0]))

    @functools.wraps(original_train)
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is None:
            resume_from_checkpoint = checkpoint
        result = original_train(self, resume_from_checkpoint, *args, **kwargs)
        leave_if_stopped(self)
        return result

    Trainer.__init__, Trainer.train = __init__, train
    Trainer._jobgen_patched = True


def _current_job() -> Job:
    job = current()
    if job is None:
        raise NotUnderJobgen("[command] hf_trainer needs the JOBGEN_RUN_DIR a jobgen batch script sets")
    return job


def _jobgen_callback(trainer) -> JobgenCallback | None:
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, JobgenCallback)), None)


def check_output_dir(output_dir: str | Path | None, checkpoint_dir: str | Path) -> None:
    """Raise :class:`OutputDirMismatch` unless ``output_dir`` is ``checkpoint_dir`` (resolved)."""
    if output_dir is not None and Path(output_dir).resolve() == Path(checkpoint_dir).resolve():
        return
    raise OutputDirMismatch(
        f"the Trainer's output_dir is {output_dir!r}, not the run's checkpoint directory {checkpoint_dir}: "
        "its checkpoints would not be where the next task resumes from. Pass it in [command] args: "
        "'--output_dir', '{checkpoint_dir}'"
    )


def leave_if_stopped(trainer) -> None:
    """After ``train()`` returned: raise :class:`PlannedStop` when jobgen's lifecycle stopped it
    (every rank agreed on that step's action, so every rank leaves here); return when training
    finished (max_steps), so the script saves its final model once."""
    callback = _jobgen_callback(trainer)
    life = callback.life if callback is not None else None
    if life is None or life.stopped_by is None:
        return
    code, reason = life.stopped_by.exit_code, life.job.describe(life.stopped_by)
    if life.job.is_main:
        log.warning(
            "jobgen: %s at step %s: the task ends here, before the script's code after train()", reason, life.step
        )
    raise PlannedStop(code, reason)
