"""jobgen's launcher for your own program (``[job] program = "command"``): what torchrun
starts on every rank, in place of the module or script itself::

    torchrun ... -m jobgen.runtime.launch --plan RUN/logs/command-plan.<job>.<restart>.json

It reads the task's plan, which the batch script wrote once on the head node
(:mod:`jobgen.launch.command_plan`: the checkpoint to resume from, the arguments and variables
with their placeholders expanded), refuses a plan of another job or attempt, sets
``os.environ``, ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` or ``python -m
MODULE ARGS`` would, and runs the program unchanged in this process (runpy, as
``__main__``). With ``[command] hf_trainer = true`` it first patches
``transformers.Trainer`` (:func:`jobgen.runtime.hf.patch_trainer`; transformers is imported
only then): the program saves and stops at a time limit and resumes without a line edited.

Importing this module imports no torch or transformers (as ``jobgen.runtime``): a program
that never touches them starts as fast as it would without jobgen.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Mapping
from pathlib import Path

from jobgen.base.atomic import write_json_atomic
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.command_plan import CommandPlan, PlanError, read_plan
from jobgen.runs.rundir import RunDir
from jobgen.runtime.devices import MissingGpu, rank_gpu
from jobgen.runtime.records import record_failure


def this_attempt(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(job id, restart count) of this process, as the batch script's Slurm environment says."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_ID") or "", int(env.get("SLURM_RESTART_COUNT") or 0)


def apply_plan(plan: CommandPlan) -> None:
    """The process as ``python SCRIPT ARGV`` / ``python -m MODULE ARGV`` would start, with the
    plan's variables on top of the job's environment."""
    os.environ.update(plan.env)
    os.environ["JOBGEN_RUN_DIR"] = plan.run_dir  # what jobgen.runtime.current() finds
    if plan.script is not None:
        sys.argv = [plan.script, *plan.argv]
        # python puts the script's own directory first (links resolved), not the cwd.
        sys.path[0] = os.path.dirname(os.path.realpath(plan.script))
    else:
        # runpy's alter_sys replaces argv[0] with the module's file, as `python -m` does;
        # sys.path[0] is already the cwd, since this launcher itself was started with -m.
        sys.argv = [str(plan.module), *plan.argv]


def record_rank_identity(run: RunDir, job_id: str, restart: int, environ: Mapping[str, str] | None = None) -> None:
    """This rank's global and group rank beside its node's torchrun logs: torchrun's own
    files name only the local rank, and the rendezvous orders nodes by address, not by
    name, so ``jobgen logs --rank N`` could not otherwise tell which node ran rank N. A
    record that cannot be written costs only that lookup."""
    env = os.environ if environ is None else environ
    node = env.get("SLURMD_NODENAME") or "local"
    path = run.rank_identity(job_id, node, restart, env.get("LOCAL_RANK", "0"))
    record: dict[str, object] = {"rank": int(env.get("RANK") or 0), "group_rank": int(env.get("GROUP_RANK") or 0)}
    try:
        gpu = rank_gpu(env)  # the program picks cuda:LOCAL_RANK of the node's list
    except MissingGpu as exc:
        gpu = None
        print(f"jobgen: {exc}", file=sys.stderr)
    if gpu is not None:
        record["gpu"] = gpu
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, record)
    except OSError as exc:
        print(f"jobgen: could not record this rank's identity at {path}: {exc}", file=sys.stderr)


def run_program(plan: CommandPlan) -> None:
    """Run the plan's script or module as ``__main__`` in this process."""
    if plan.script is not None:
        runpy.run_path(plan.script, run_name="__main__")
    else:
        runpy.run_module(str(plan.module), run_name="__main__", alter_sys=True)


def _fail(plan_or_run: CommandPlan | RunDir | None, code: ExitCode, reason: str) -> int:
    """A start refused: the reason on stderr (the rank's log) and, from rank 0, in the exit
    record the batch script reads (and the failed marker, for a failure that would repeat)."""
    print(f"jobgen: {reason}", file=sys.stderr, flush=True)
    run = RunDir(Path(plan_or_run.run_dir)) if isinstance(plan_or_run, CommandPlan) else plan_or_run
    if run is not None and os.environ.get("RANK", "0") == "0":
        job_id, restart = this_attempt()
        try:
            record_failure(run, job_id or None, restart, code, reason)
        except OSError as exc:
            print(f"jobgen: could not record the exit reason: {exc}", file=sys.stderr)
    return int(code)


def launch(plan_path: str | Path) -> int:
    """Everything but the argument parsing: the exit status of this rank."""
    job_id, restart = this_attempt()
    run_dir = os.environ.get("JOBGEN_RUN_DIR")
    try:
        plan = read_plan(plan_path, job_id, restart)
    except PlanError as exc:
        return _fail(RunDir(Path(run_dir)) if run_dir else None, ExitCode.LAUNCH_ERROR, str(exc))
    apply_plan(plan)
    record_rank_identity(RunDir(Path(plan.run_dir)), job_id, restart)
    if not plan.hf_trainer:
        run_program(plan)
        _leave_process_group(barrier=False)
        return 0
    from jobgen.runtime import hf  # transformers: only for a program that has a Trainer

    hf.patch_trainer(plan.checkpoint_dir, plan.checkpoint)
    try:
        run_program(plan)
    except hf.PlannedStop as stop:
        # The callback wrote the exit record and the checkpoint is complete: nothing of the
        # script's after train() runs.
        _leave_process_group()
        return int(stop.exit_code)
    except hf.OutputDirMismatch as exc:
        return _fail(plan, ExitCode.PROGRAM_SETUP, str(exc))
    _leave_process_group(barrier=False)
    return 0


def _leave_process_group(*, barrier: bool = True) -> None:
    """Tear down the process group a program left standing (a Trainer script never destroys
    it), while the interpreter is whole: left to the interpreter's exit, gloo's threads may still
    hold work whose tensors are freed during finalisation, and the rank dies of SIGABRT
    ("terminate called without an active exception") after the program succeeded
    (pytorch/pytorch#179291; seen here once in CI, on an HF Trainer's resumed task).
    With ``barrier``, after a PlannedStop: every rank raised it at the same step (the action was
    agreed), so all meet here first, and none leaves while another still writes its part of the
    checkpoint (the Trainer saves each rank's RNG state with no barrier after it). A program
    that returned needs no barrier: its ranks may end at different times, and destroying the
    group is each rank's own business."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobgen.runtime.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", required=True, type=Path, help="the task's plan (jobgen.launch.command_plan)")
    args = parser.parse_args(argv)
    return launch(args.plan)


if __name__ == "__main__":
    sys.exit(main())
