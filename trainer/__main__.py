"""The bundled SFT trainer, one process per GPU (or per CPU slot), under torchrun.

Launched on every node by the rendered ``train.sbatch``::

    torchrun --nnodes=$SLURM_NNODES --nproc-per-node=8 --rdzv-backend=c10d ... \\
        -m trainer --run-dir RUN_DIR --expected-world-size 16

or by hand on one machine, for a run directory that ``jobgen submit`` wrote::

    torchrun --standalone --nproc-per-node=2 -m trainer --run-dir RUN_DIR --expected-world-size 2

Reads the resolved spec from ``RUN_DIR/spec.json``; exits with one of the codes in
``jobgen.base.exit_codes`` and logs a one-line reason.

Owns one trainer process from start to exit: whether it may start at all
(:func:`refuse_to_start`), building and running the Trainer (:func:`train`), and
what it leaves for the batch script and later tasks (:func:`record_exit`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobgen.base.exit_codes import ExitCode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer")
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory holding spec.json")
    parser.add_argument(
        "--expected-world-size",
        type=int,
        help="the processes of every node summed (ResolvedSpec.world_size); checked against torchrun's",
    )
    return parser.parse_args(argv)


def setup_logging() -> None:
    # Progress bars from every rank would bury the log lines that matter.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"%(asctime)s trainer[{rank}] %(levelname)s %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        stream=sys.stdout,
    )
    if os.environ.get("LOCAL_RANK", "0") == "0":
        # The first rank of every node tokenizes a share of the data: its node's log says which and how fast.
        for name in ("trainer.data.collective", "trainer.data.build", "trainer.data.prepare"):
            logging.getLogger(name).setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    log = logging.getLogger("trainer")
    started = time.time()

    # Heavy imports after argument parsing, so --help stays instant.
    from jobgen.runs.rundir import RunDir
    from trainer.memory import host_allocator

    run = RunDir(args.run_dir.absolute())
    spec = run.load_spec()
    # Before anything large is allocated: whether freed tensors go back to the system or
    # stay in glibc's heaps (the module says what each costs).
    allocator = host_allocator.configure(spec)
    if os.environ.get("RANK", "0") == "0":
        log.info("%s", allocator)

    from jobgen.base.lease import WriterLease
    from jobgen.runtime.devices import MissingGpu
    from trainer import distributed
    from trainer.metrics import StartupClock

    startup = StartupClock(started)
    startup.mark("imports")
    attempt = Attempt.from_environ()
    try:
        env = distributed.init_distributed(spec.run.train.collective_timeout, None, use_gpu=spec.site.slurm.gpu_compute)
    except MissingGpu as exc:  # the start probe refuses such a node first; this rank says why too
        from jobgen.runtime.records import record_failure

        log.error("%s", exc)
        record_failure(run, attempt.job_id or None, attempt.restart, ExitCode.LAUNCH_ERROR, str(exc))
        return int(ExitCode.LAUNCH_ERROR)
    record_ranks(run, attempt, env)
    if env.is_main and attempt.job_id:
        from jobgen.runtime.records import reserve_exit_code

        reserve_exit_code(run, attempt.job_id, attempt.restart)  # the reason gets out of a full disk
    return run_attempt(spec, run, env, attempt, startup, WriterLease(run.writer_lease), args.expected_world_size)


def run_attempt(spec, run, env, attempt: Attempt, startup, lease, expected_world_size: int | None) -> int:
    """This attempt, from its start checks to its exit record: what every later task needs to
    know of it is written by rank 0 however it ends (short of SIGKILL)."""
    from trainer import distributed

    log = logging.getLogger("trainer")
    code, reason, progress = ExitCode.OK, "", Progress()
    try:
        # One decision for all ranks, taken by rank 0 before anything is loaded or written.
        refusal = distributed.broadcast_object(
            env, refuse_to_start(run, lease, env.world_size, expected_world_size) if env.is_main else None
        )
        if refusal is not None:
            code, reason = refusal
            return int(code)
        progress.started = env.is_main and record_start(run, attempt)
        startup.mark("rendezvous")  # the process group, and rank 0's start checks
        code, reason = train(spec, run, env, attempt, startup, progress)
        return int(code)
    except BaseException as exc:
        from jobgen.runtime.records import CrashSignature, crash_reason

        code, reason = ExitCode.CRASHED, crash_reason(exc, run.path)
        progress.crash = CrashSignature.of(exc, progress.step)
        progress.repeats_at_once = progress.building and will_repeat(exc)
        record_rank_end(run, attempt, env, exc)
        raise
    finally:
        if env.is_main:
            reason = record_exit(run, attempt, code, reason, progress)
            log.info("exit %d: %s", int(code), reason or code.reason)
        if not progress.snapshot_left_behind:  # else the process's exit ends the group (exit_now)
            distributed.shutdown()


@dataclass(frozen=True)
class Attempt:
    """Which run of which job this process belongs to: a requeued job keeps its id and
    only the restart count tells its attempts apart; inside one, the batch script counts
    its relaunches of the program (job.in_job_restarts)."""

    job_id: str | None
    restart: int
    array_job_id: str | None = None  # one submission's tasks share it
    launch: int = 0  # the batch script's relaunch of the program inside this attempt: 0 is the first

    @classmethod
    def from_environ(cls) -> Attempt:
        restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        launch = int(os.environ.get("JOBGEN_LAUNCH") or 0)
        return cls(os.environ.get("SLURM_JOB_ID"), restart, os.environ.get("SLURM_ARRAY_JOB_ID"), launch)


@dataclass
class Progress:
    """How far this process got, for the rule that stops a run after the same crash in two
    tasks in a row (jobgen.runtime.records.attempt_ended): whether rank 0 recorded the attempt's
    start, the Trainer once built (its step), and how it crashed."""

    started: bool = False
    trainer: Any = None
    crash: Any = None  # jobgen.runtime.records.CrashSignature
    building: bool = False  # the Trainer is being built: data, model, optimizer, before any step
    repeats_at_once: bool = False  # a crash building it that every task would meet (will_repeat)

    @property
    def snapshot_left_behind(self) -> bool:
        """The Trainer's end left a snapshot's writer inside the mirror's collective: destroying
        the process group would wait for it, up to the collective timeout."""
        return bool(getattr(self.trainer, "snapshot_left_behind", False))

    @property
    def step(self) -> int | None:
        """The step the run had reached (the resumed one before this task's first), None before
        the Trainer exists."""
        return getattr(self.trainer, "step", None)


def record_start(run, attempt: Attempt) -> bool:
    """Rank 0, past the start checks: this attempt runs (what a crash of it would repeat)."""
    from jobgen.runtime.records import attempt_started

    if not attempt.job_id:
        return False
    try:
        attempt_started(run, attempt.job_id, attempt.restart, attempt.array_job_id, attempt.launch)
    except OSError as exc:  # bookkeeping for the repeat rule: never a reason not to train
        logging.getLogger("trainer").warning("could not record this attempt's start: %s", exc)
        return False
    return True


def _gpu_words(env) -> str:
    """This rank's GPU for its start line: the one it computes on, or would on a site whose
    ranks compute on the CPU (slurm.gpu_compute = false)."""
    if env.gpu is None:
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    how = "" if env.device.type == "cuda" else ", not used: the site computes on the CPU"
    return f", GPU {env.gpu} of CUDA_VISIBLE_DEVICES={visible}{how}"


def record_ranks(run, attempt: Attempt, env) -> None:
    """Where each global rank runs (node, local rank), for ``jobgen logs --rank``: torchrun's
    per-rank log directories name only the node and the local rank."""
    import torch.distributed as dist

    from jobgen.base.atomic import write_json_atomic

    mine = {
        "node": os.environ.get("SLURMD_NODENAME") or "local",
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "gpu": env.gpu,
    }
    # One line from every rank (the others log only warnings): where each one runs, in its own log.
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(
        f"{stamp} trainer[{env.rank}] INFO rank {env.rank} of {env.world_size} on {mine['node']} "
        f"(local rank {mine['local_rank']}{_gpu_words(env)}), pid {os.getpid()}",
        flush=True,
    )
    if not attempt.job_id:
        return
    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    if env.is_main:
        try:
            write_json_atomic(run.rank_map(attempt.job_id, attempt.restart), dict(enumerate(everyone)))
        except OSError as exc:  # a log aid: never a reason not to train
            logging.getLogger("trainer").warning("could not record the rank map: %s", exc)


def record_rank_end(run, attempt: Attempt, env, exc: BaseException) -> None:
    """Every rank an error reaches says so, with how long it had gone without progress: the
    batch script's node check (jobgen.runs.quarantine) blames the nodes whose ranks said nothing
    while others waited out a collective timeout."""
    from jobgen.runs.quarantine import record_rank_failure
    from jobgen.runtime.stopping import first_signal_caught
    from trainer.distributed import seconds_since_progress

    if attempt.job_id:
        record_rank_failure(
            run,
            attempt.job_id,
            attempt.restart,
            env.rank,
            seconds_since_progress(),
            exc,
            first_signal_caught(),
            attempt.launch,
        )


def refuse_to_start(run, lease, world_size: int, expected_world_size: int | None) -> tuple[ExitCode, str] | None:
    """Rank 0: why this process must not train, or None. Takes the writer lease first, so a
    second writer leaves before it reads or writes anything of the run."""
    from jobgen.base.lease import RunBusy
    from jobgen.runtime.stopping import Action, startup_switch

    try:
        lease.acquire()
    except RunBusy as exc:
        return ExitCode.RUN_BUSY, str(exc)
    failed = run.failure()
    if failed is not None:
        return ExitCode.NOT_STARTED, (
            f"the run stopped after a failure that would repeat (exit {failed.get('exit_code')}: "
            f"{failed.get('reason')}); {failed.get('fix')}"
        )
    switch = startup_switch(run.switches)
    if switch is not Action.CONTINUE:
        return ExitCode.NOT_STARTED, f"{switch.name.lower()} switch present at start: not starting"
    if run.done_marker.exists():
        return ExitCode.OK, "run already finished (done marker present)"
    if expected_world_size is not None and world_size != expected_world_size:
        return ExitCode.WORLD_SIZE_MISMATCH, (
            f"world size is {world_size}, the spec asks for {expected_world_size} (job.procs_per_node over job.nodes)"
        )
    return None


def train(spec, run, env, attempt: Attempt, startup, progress: Progress) -> tuple[ExitCode, str]:
    """Build the trainer and fit; failures that every later task would repeat come back as
    their exit codes (typed exceptions, never matched on message text)."""
    from jobgen.model.pipeline_split import PipelineSplitError
    from jobgen.spec.global_batch import GlobalBatchChanged
    from trainer.checkpoints.checkpointer import ResumeFailed
    from trainer.data.cache import DataCacheError
    from trainer.data.formats import DataError
    from trainer.data.sampler import ResumeMismatch
    from trainer.model.errors import ModelError

    monitor = stop_monitor(spec, run, env, attempt)
    from trainer.loop import Trainer

    startup.mark("imports")  # transformers, datasets
    try:
        progress.building = True
        trainer = progress.trainer = Trainer(spec, run.path, env, monitor, startup)
        progress.building = False
    except (DataError, DataCacheError) as exc:
        return ExitCode.DATA_ERROR, f"{type(exc).__name__}: {exc}"
    except (ModelError, PipelineSplitError, *peft_target_errors(spec)) as exc:
        # The model cannot be built as [model] and [train] ask: a split that does not fit its
        # blocks, LoRA targets it lacks (validate checks both for a local model).
        return ExitCode.MODEL_ERROR, f"{type(exc).__name__}: {exc}"
    try:
        code, reason = trainer.fit()
    except ResumeFailed as exc:
        code, reason = ExitCode.RESUME_FAILED, str(exc)
    except ResumeMismatch as exc:
        code, reason = ExitCode.RESUME_MISMATCH, str(exc)
    except GlobalBatchChanged as exc:
        code, reason = ExitCode.BATCH_CHANGED, str(exc)
    trainer.write_summary(code, reason)
    return code, reason


def stop_monitor(spec, run, env, attempt: Attempt):
    """What stops this attempt (switches, the stop request, the deadline, the memory guard),
    its signal handlers installed; the device's memory capped to the site's."""
    from jobgen.runtime.stopping import StopMonitor, StopSettings, job_end_time
    from trainer import distributed

    graceful = spec.run.job.graceful_stop
    end = distributed.broadcast_object(env, job_end_time(attempt.job_id) if env.is_main and graceful else None)
    deadline = end - spec.run.job.exit_grace if end else None
    stop_request = run.stop_request(attempt.job_id, attempt.restart) if attempt.job_id and graceful else None
    monitor = StopMonitor(
        StopSettings(
            run.switches,
            stop_request,
            deadline,
            spec.run.train.max_host_memory_percent,
            spec.run.train.min_gpu_free_memory_mib,
            check_files=env.is_main,
            lead_signal=spec.site.slurm.signal,
            exit_grace=spec.run.job.exit_grace,
            gpu_free_bytes=distributed.gpu_free_bytes if env.device.type == "cuda" else None,
        )
    )
    if graceful:
        monitor.install_signal_handlers()
    elif env.is_main:
        logging.getLogger("trainer").info("job.graceful_stop = false: signals and the deadline end this job unsaved")
    if spec.site.slurm.device_memory:
        from jobgen.base.sizes import parse_size

        fraction = distributed.cap_device_memory(env, parse_size(spec.site.slurm.device_memory))
        if fraction is not None and env.is_main:
            logging.getLogger("trainer").info(
                "GPU memory capped at %s (%.0f%% of the device)", spec.site.slurm.device_memory, 100 * fraction
            )
    return monitor


def will_repeat(exc: BaseException) -> bool:
    """Whether a crash building the Trainer (before its first step) is one every task would meet:
    an error of the code or of what it was given (a model the code does not handle, a setting it
    cannot apply: TypeError, AttributeError, ValueError, LookupError, NotImplementedError,
    ImportError...), not one of the machine or the world (a file system, memory, a collective,
    a timeout), which a task on other nodes or at another time may not meet. Typed, never
    matched on message text."""
    import torch
    import torch.distributed as dist

    from jobgen.runtime.records import disk_full

    of_the_world = (OSError, MemoryError, TimeoutError, torch.OutOfMemoryError, dist.DistError)
    if isinstance(exc, of_the_world) or disk_full(exc) is not None:
        return False
    of_the_code = (
        TypeError,
        AttributeError,
        ValueError,
        LookupError,
        NotImplementedError,
        ImportError,
        NameError,
        AssertionError,
        ArithmeticError,
    )
    return isinstance(exc, of_the_code)


def peft_target_errors(spec) -> tuple[type[BaseException], ...]:
    """peft's typed error for LoRA targets that match no module of the model (peft >= 0.14)."""
    if spec.run.model is None or spec.run.model.lora is None:
        return ()
    try:
        from peft.tuners.tuners_utils import NoMatchingPeftModuleError
    except ImportError:  # an older peft raises a plain ValueError: the repeat rule catches it
        return ()
    return (NoMatchingPeftModuleError,)


def record_exit(run, attempt: Attempt, code: ExitCode, reason: str, progress: Progress) -> str:
    """Rank 0, however the process ends short of SIGKILL: the exit code for the batch script
    (this attempt's own file), and the ``failed`` marker when every later task would fail
    the same way: a failure of a kind that repeats (``code.repeats``), or a crash that the
    previous task of the run had exactly so (same exception, same place, same step), which
    will not go away by itself either; or a crash building the Trainer that any task would meet
    (:func:`will_repeat`), at once. Returns the reason as recorded."""
    from jobgen.runtime.records import attempt_ended, record_failure

    repeated = None
    if progress.started and attempt.job_id:
        try:
            repeated = attempt_ended(
                run, attempt.job_id, attempt.restart, attempt.array_job_id, progress.crash, attempt.launch
            )
        except OSError as exc:
            logging.getLogger("trainer").warning("could not record how this attempt ended: %s", exc)
    if progress.repeats_at_once and repeated is None:
        return record_failure(run, attempt.job_id, attempt.restart, code, reason, progress.crash, at_once=True)
    return record_failure(run, attempt.job_id, attempt.restart, code, reason, repeated)


if __name__ == "__main__":
    from trainer.distributed import exit_now

    # A crash still raises through the interpreter, so its traceback is printed as usual.
    exit_now(main())
