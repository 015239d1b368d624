"""The bundled SFT trainer, one process per GPU (or per CPU slot), under torchrun.

Launched on every node by the rendered ``train.sbatch``::

    torchrun --nnodes=$SLURM_NNODES --nproc-per-node=8 --rdzv-backend=c10d ... \\
        -m trainer --run-dir RUN_DIR --expected-world-size 16

or by hand on one machine, for a run directory that ``jobgen submit`` wrote::

    torchrun --standalone --nproc-per-node=2 -m trainer --run-dir RUN_DIR --expected-world-size 2

Reads the resolved spec from ``RUN_DIR/spec.json``; exits with one of the codes in
``jobgen.exit_codes`` and logs a one-line reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from jobgen.exit_codes import ExitCode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer")
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory holding spec.json")
    parser.add_argument("--expected-world-size", type=int, help="nodes x procs_per_node; checked against torchrun's")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    log = logging.getLogger("trainer")
    run_dir = args.run_dir.absolute()
    started = time.time()

    # Heavy imports after argument parsing, so --help stays instant.
    from jobgen.rundir import RunDir
    from trainer import distributed
    from trainer.stopping import Action, StopMonitor, StopSettings, job_end_time, startup_switch

    spec = RunDir(run_dir).load_spec()
    switches = run_dir / "switches"
    try:
        env = distributed.init_distributed(spec.run.train.collective_timeout, args.expected_world_size)
    except distributed.WorldSizeError as exc:
        log.error("%s", exc)
        return int(ExitCode.WORLD_SIZE_MISMATCH)

    code, reason = ExitCode.OK, ""
    try:
        # One decision for all ranks, before anything is loaded.
        early = distributed.broadcast_object(env, int(startup_switch(switches)) if env.is_main else None)
        if early:
            code, reason = ExitCode.NOT_STARTED, f"{Action(early).name.lower()} switch present at start: not starting"
            return int(code)
        if (run_dir / "done").exists():
            code, reason = ExitCode.OK, "run already finished (done marker present)"
            return int(code)
        job_id = os.environ.get("SLURM_JOB_ID")
        end = distributed.broadcast_object(env, job_end_time(job_id) if env.is_main else None)
        deadline = end - spec.run.job.exit_grace if end else None
        monitor = StopMonitor(StopSettings(switches, job_id, deadline, spec.run.train.max_host_memory_percent,
                                           spec.run.train.min_gpu_free_memory_mib, check_files=env.is_main))
        monitor.install_signal_handlers()
        from trainer.loop import Trainer

        trainer = Trainer(spec, run_dir, env, monitor)
        trainer.started = started
        try:
            code, reason = trainer.fit()
        except RuntimeError as exc:
            if "could be loaded" not in str(exc):
                raise
            code, reason = ExitCode.RESUME_FAILED, str(exc)
        trainer.write_summary(code, reason)
        return int(code)
    except BaseException as exc:
        code, reason = ExitCode.CRASHED, f"crashed: {type(exc).__name__}: {str(exc)[:300]}"
        raise
    finally:
        if env.is_main:
            log.info("exit %d: %s", int(code), reason or code.reason)
        distributed.shutdown()


def exit_now(code: int) -> None:
    """Leave without Python's finalization. Everything the run needs (checkpoints,
    metrics, the done marker) is written and fsynced by now, and the process group is
    destroyed; what finalization would add is only C++ static destructors, and one of
    them (a still-joinable std::thread) aborted a finished gloo worker with SIGABRT
    ("terminate called without an active exception") in 2 of 4 fresh-clone CI runs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # A crash still raises through the interpreter, so its traceback is printed as usual.
    exit_now(main())
