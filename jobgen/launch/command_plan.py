"""One decision per array task of a ``program = "command"`` run, agreed by every rank: the
checkpoint it resumes from, and the arguments and environment that follow from it.

The batch script runs this on the head node before srun (``py_on_head``: the job's Python
environment; no torch is imported)::

    python -m jobgen.launch.command_plan --run-dir RUN --job 42 --restart 0 --task 3

It finds the newest complete checkpoint once ([command] checkpoints,
:mod:`jobgen.program.checkpoints`), expands the placeholders of ``[command] args``,
``resume_args`` and ``[env]`` (:mod:`jobgen.program.placeholders`), and writes the plan as JSON to
``RunDir.command_plan(job, restart)``, atomically (a reader sees a whole plan or none).
Every rank's launcher (:mod:`jobgen.runtime.launch`) reads that one file: no rank lists the
checkpoint directory itself, so no two ranks can resume from different checkpoints when a
save lands while they start. The plan names its attempt; a launcher refuses one written
for another job or another attempt of the same job (a requeued job keeps its id).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobgen.base.atomic import write_json_atomic
from jobgen.base.safe_read import DamagedFile, read_json
from jobgen.base.visible import visible
from jobgen.program import placeholders
from jobgen.program.checkpoints import latest_checkpoint
from jobgen.runs.rundir import RunDir
from jobgen.spec.resolved import ResolvedSpec

PLAN_VERSION = 1


class PlanError(RuntimeError):
    """A task's plan that cannot be used; the message says which file and why."""


class PlanUnreadable(PlanError):
    """The plan file is missing, cut, or not a plan of this jobgen."""


class PlanForAnotherAttempt(PlanError):
    """The plan was written for another job, or another attempt of this one: nothing an
    earlier attempt decided is acted on."""


@dataclass(frozen=True)
class CommandPlan:
    """What every rank of one attempt runs: ``python -m MODULE ARGV`` or ``python SCRIPT
    ARGV`` with ``env`` set on top of the job's environment."""

    job_id: str
    restart: int
    task: str
    run_dir: str
    checkpoint_dir: str
    module: str | None
    script: str | None
    argv: list[str]
    env: dict[str, str]
    hf_trainer: bool
    checkpoint: str | None  # the newest complete checkpoint, or None: a fresh start
    checkpoint_rule: str
    version: int = field(default=PLAN_VERSION)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, source: str) -> CommandPlan:
        """The plan in ``data`` (read from ``source``), checked field by field."""
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise PlanUnreadable(f"{source} is not a version {PLAN_VERSION} command plan")
        types = {
            "job_id": str,
            "restart": int,
            "task": str,
            "run_dir": str,
            "checkpoint_dir": str,
            "argv": list,
            "env": dict,
            "hf_trainer": bool,
            "checkpoint_rule": str,
        }
        optional = ("module", "script", "checkpoint")
        bad = [k for k, t in types.items() if not isinstance(data.get(k), t)]
        bad += [k for k in optional if data.get(k) is not None and not isinstance(data[k], str)]
        argv, env = data.get("argv"), data.get("env")
        bad += ["argv"] if isinstance(argv, list) and not all(isinstance(a, str) for a in argv) else []
        bad += ["env"] if isinstance(env, dict) and not all(isinstance(v, str) for v in env.values()) else []
        if bad or (data.get("module") is None) == (data.get("script") is None):
            raise PlanUnreadable(f"{source} is no valid command plan (bad or missing: {', '.join(bad) or 'module'})")
        return cls(**{k: data.get(k) for k in (*types, *optional)}, version=PLAN_VERSION)


def placeholder_values(run: RunDir, job_id: str, task: str, checkpoint: str | None) -> dict[str, str]:
    """What each placeholder stands for in this task (no ``latest_checkpoint`` without one)."""
    values = {
        placeholders.RUN_DIR: str(run.path),
        placeholders.CHECKPOINT_DIR: str(run.checkpoints),
        placeholders.JOB_ID: job_id,
        placeholders.TASK: task,
    }
    if checkpoint is not None:
        values[placeholders.LATEST_CHECKPOINT] = checkpoint
    return values


def build_plan(spec: ResolvedSpec, run: RunDir, job_id: str, restart: int, task: str) -> CommandPlan:
    """The plan of one attempt: the checkpoint found now, the words and variables it implies."""
    command = spec.run.command
    if command is None:  # [command] is there exactly when the program is your own (RunSpec)
        raise PlanError(f"{run.path} runs program '{spec.run.job.program}', not a command: it has no plan")
    checkpoint = latest_checkpoint(run.checkpoints, command.checkpoints)
    values = placeholder_values(run, job_id, task, checkpoint)
    argv = [placeholders.expand(arg, values) for arg in command.args]
    if checkpoint is not None:
        argv += [placeholders.expand(arg, values) for arg in command.resume_args]
    env = {
        name: placeholders.expand(value, values)
        for name, value in spec.run.env.items()
        # A variable naming the checkpoint is unset, not empty, until there is one.
        if checkpoint is not None or placeholders.LATEST_CHECKPOINT not in placeholders.names_in(value)
    }
    return CommandPlan(
        job_id=job_id,
        restart=restart,
        task=task,
        run_dir=str(run.path),
        checkpoint_dir=str(run.checkpoints),
        module=command.module,
        script=command.script,
        argv=argv,
        env=env,
        hf_trainer=command.hf_trainer,
        checkpoint=checkpoint,
        checkpoint_rule=command.checkpoints,
    )


def write_plan(run: RunDir, plan: CommandPlan) -> Path:
    """The plan at its attempt's name: written to a temporary file, fsynced, renamed."""
    path = run.command_plan(plan.job_id, plan.restart)
    write_json_atomic(path, plan.to_json())
    return path


def read_plan(path: str | Path, job_id: str, restart: int) -> CommandPlan:
    """The plan at ``path``, if it is this attempt's (job ``job_id``, restart ``restart``)."""
    try:
        data = read_json(Path(path))
    except FileNotFoundError:
        raise PlanUnreadable(f"cannot read the command plan {path}: there is none") from None
    except DamagedFile as exc:  # not JSON, a link, a FIFO: jobgen.base.safe_read
        raise PlanUnreadable(f"the command plan {exc}") from None
    plan = CommandPlan.from_json(data, str(path))
    if (plan.job_id, plan.restart) != (job_id, restart):
        raise PlanForAnotherAttempt(
            f"the command plan {path} was written for job {visible(plan.job_id)} attempt {plan.restart}, and this "
            f"is job {job_id} attempt {restart}: refusing to act on another attempt's decision"
        )
    return plan


def describe(plan: CommandPlan) -> str:
    """One line for the batch log."""
    start = (
        f"resuming from {plan.checkpoint}"
        if plan.checkpoint
        else f"starting fresh (nothing matching '{plan.checkpoint_rule}' in {plan.checkpoint_dir} yet)"
    )
    program = f"-m {plan.module}" if plan.module else plan.script
    return f"task plan: {start}; {program} with {len(plan.argv)} argument(s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobgen.launch.command_plan", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--job", required=True, help="SLURM_JOB_ID")
    parser.add_argument("--restart", type=int, default=0, help="SLURM_RESTART_COUNT")
    parser.add_argument("--task", default="0", help="SLURM_ARRAY_TASK_ID")
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir.absolute())
    try:
        plan = build_plan(run.load_spec(), run, args.job, args.restart, args.task)
        path = write_plan(run, plan)
    except (OSError, ValueError, PlanError) as exc:
        why = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else str(exc)
        print(f"jobgen: could not write this task's command plan: {why}", file=sys.stderr)
        return 1
    print(f"jobgen: {describe(plan)} ({path.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
