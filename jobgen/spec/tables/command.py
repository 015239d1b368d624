"""The ``[command]`` table of ``run.toml``: your own program (``job.program = "command"``),
and how jobgen starts, stops and resumes it (docs/own-program.md).

Key names are part of the product contract; descriptions are the reference documentation
and feed ``jobgen schema``. The placeholders' syntax is :mod:`jobgen.program.placeholders`, the
checkpoint rules :mod:`jobgen.program.checkpoints`, the per-task decision
:mod:`jobgen.launch.command_plan`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from jobgen.program import placeholders
from jobgen.program.checkpoints import HF_CHECKPOINTS
from jobgen.spec.fields import EnvValue, SafePath, SpecModel, matching

# A dotted Python module name: my_project.train
PythonModule = matching(
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
    "a Python module name",
    "names of letters, digits and '_' joined by dots, e.g. 'my_project.train' (a file belongs in command.script)",
)
# One argument of the program; placeholders checked with the key's own rules (jobgen.program.placeholders).
CommandArg = Annotated[EnvValue, AfterValidator(lambda v: placeholders.check(v, placeholders.IN_ARGS, "command.args"))]
ResumeArg = Annotated[
    EnvValue, AfterValidator(lambda v: placeholders.check(v, placeholders.IN_RESUME_ARGS, "command.resume_args"))
]
# A glob over the names in the checkpoint directory: one name, never a path.
CheckpointRule = matching(
    r"^[A-Za-z0-9_.*?\[\]!+=,@-]{1,128}$",
    "a glob over the names in the checkpoint directory",
    "one name pattern of letters, digits and _ . * ? [ ] ! + = , @ -, e.g. 'step-*' (no '/'), at most 128 characters",
    chars=r"[A-Za-z0-9_.*?\[\]!+=,@-]",
)

_PLACEHOLDER_HELP = (
    "Placeholders, expanded by jobgen for each array task (never by a shell): {run_dir}, {checkpoint_dir} "
    "(RUN/checkpoints), {job_id}, {task} (the array index)"
)


class CommandSpec(SpecModel):
    """Your own program (job.program = 'command'), started by torchrun on every node as the
    bundled trainer is, through jobgen's launcher (jobgen.runtime.launch), which runs it
    unchanged with the arguments and environment jobgen decided for the task. It reaches
    the run directory, the switches and the deadline through ``jobgen.runtime``
    (docs/own-program.md), or gets them without a line changed with ``hf_trainer``."""

    module: PythonModule | None = Field(
        None, description="Run as `python -m MODULE` on every rank, e.g. 'my_project.train' (found from workdir)."
    )
    script: SafePath | None = Field(
        None, description="A Python script run as `python SCRIPT` on every rank; relative to run.toml's directory."
    )
    args: list[CommandArg] = Field(
        default_factory=list,
        description=(
            "Arguments after the module or script; each entry reaches the program as one argument, as written. "
            f"{_PLACEHOLDER_HELP}; {{{{ and }}}} are literal braces. {{latest_checkpoint}} belongs in "
            "resume_args."
        ),
    )
    resume_args: list[ResumeArg] = Field(
        default_factory=list,
        description=(
            "Arguments appended to args only when the run has a checkpoint to resume from (see checkpoints), so "
            "the first task starts fresh and every later one resumes, e.g. "
            "['--resume_from_checkpoint', '{latest_checkpoint}']. The placeholders of args, and "
            "{latest_checkpoint}: the newest complete checkpoint's path."
        ),
    )
    checkpoints: CheckpointRule = Field(
        HF_CHECKPOINTS,
        description=(
            "How the newest complete checkpoint your program left in {checkpoint_dir} is found ({latest_checkpoint}, "
            "hf_trainer's resume): a glob over the names there. 'checkpoint-*' (the default) is the Hugging Face "
            "Trainer's checkpoint-N directories, complete when trainer_state.json reads back with global_step N "
            "(one a kill cut short is skipped). Any other glob, e.g. 'step-*' or '*.pt': the match with the "
            "highest number in its name (the last run of digits); names without a number rank below, newest by "
            "modification time; names starting with a dot never match."
        ),
    )
    hf_trainer: bool = Field(
        False,
        description=(
            "The program trains with a Hugging Face transformers.Trainer: jobgen's launcher adds its "
            "JobgenCallback to every Trainer the program builds, checks that output_dir is {checkpoint_dir} "
            "(pass --output_dir {checkpoint_dir}), and resumes train() from the newest complete checkpoint "
            "when the program names none. A time limit, SIGTERM, the kill switch or the memory guard then "
            "saves a checkpoint and ends the task right after it, before the program's own code after "
            "train() runs (so no 'final' model is written on a stop); the next task redoes no step."
        ),
    )
    stop_signal: Literal["TERM", "INT", "none"] | None = Field(
        None,
        description=(
            "What the batch shell forwards to the program's processes when Slurm's lead-time signal or SIGTERM "
            "arrives: 'TERM' (torchrun forwards it to its workers; most frameworks stop on it), 'INT', or "
            "'none' (the program reads jobgen's stop request itself: jobgen.runtime, or hf_trainer = true). "
            "Default: 'none' with hf_trainer, else 'TERM'."
        ),
    )
    workdir: SafePath | None = Field(
        None, description="Directory the program starts in; relative to run.toml's directory (default: that directory)."
    )

    @model_validator(mode="after")
    def _module_or_script(self) -> CommandSpec:
        if (self.module is None) == (self.script is None):
            raise ValueError(
                "give exactly one of command.module (run as torchrun -m MODULE) and command.script (a .py path)"
            )
        return self

    @model_validator(mode="after")
    def _resolve_stop_signal(self) -> CommandSpec:
        # Stored resolved, so spec.json says what the job does whatever the default becomes.
        if self.stop_signal is None:
            self.stop_signal = "none" if self.hf_trainer else "TERM"
        return self
