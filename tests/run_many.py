"""Several run directories trained one after another by the bundled trainer in one torchrun: one
process group, and one import of torch and transformers, for all of them instead of a torchrun
each (the model-family matrix, tests/distributed/test_family_matrix.py, trains 60 small runs).

    torchrun --standalone --nproc-per-node=2 tests/run_many.py RUN_DIR [RUN_DIR...]

Each run goes through ``trainer.__main__.train`` as a task of its own would (its Trainer built,
fitted and its summary written); an exception stops everything, naming the run it came from.
Runs that no Slurm job started: no attempt records, no writer lease.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path


def main(paths: list[str]) -> int:
    from jobgen.base.exit_codes import ExitCode
    from jobgen.runs.rundir import RunDir
    from trainer import distributed
    from trainer.__main__ import Attempt, Progress, setup_logging, train
    from trainer.metrics import StartupClock

    setup_logging()
    log = logging.getLogger("trainer")
    runs = [RunDir(Path(path).absolute()) for path in paths]
    specs = [run.load_spec() for run in runs]
    env = distributed.init_distributed(max(spec.run.train.collective_timeout for spec in specs), None)
    failed = 0
    try:
        for run, spec in zip(runs, specs, strict=True):
            log.info("run_many: %s", run.path)
            try:
                code, reason = train(spec, run, env, Attempt(None, 0), StartupClock(time.time()), Progress())
            except BaseException:
                log.error("run_many: %s crashed", run.path)
                raise
            if code != ExitCode.OK:
                failed += 1
                log.error("run_many: %s ended with exit %d: %s", run.path, int(code), reason)
    finally:
        distributed.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    from trainer.distributed import exit_now

    exit_now(main(sys.argv[1:]))
