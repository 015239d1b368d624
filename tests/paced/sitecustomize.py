"""Paced training steps for the dev cluster's scenarios: every Python process started with this
folder on PYTHONPATH runs this first (tests/conftest.py puts it there for the tests that use the
dev cluster; the batch script keeps it behind jobgen's own checkout). In a training rank (torchrun
sets RANK) with PACED_STEP_SECONDS set (tests/helpers.py writes it into the [env] of the runs that
train until something stops them), each optimizer step starts at least that many seconds after
the previous one: the bundled trainer, a Hugging Face Trainer and a plain torch loop alike,
without touching any of them.

Why: those scenarios train until something happens to the run (a time limit, a signal, a switch,
a killed rank), and an unpaced tiny model on CPU takes every core it is given while it waits: on
CI's 2 cores the steps nobody looks at took the CPU the other workers' tests needed. A paced rank
behaves as one whose steps are slower (a GPU rank's CPU waits on its device much of a step): it
still computes every step, takes signals between steps and saves on request; fewer steps fit in
a time limit.

A training step ends when an optimizer that stepped in it steps again: a rank holding two
pipeline stages, or an optimizer for each parameter, steps several optimizers in one.
"""

import os

# Any other process started with this folder on PYTHONPATH (every jobgen call of the batch
# script, a test's own subprocesses) pays for this line only.
PERIOD = float(os.environ.get("PACED_STEP_SECONDS") or 0)
if PERIOD > 0 and os.environ.get("RANK") is not None:
    from paced_steps import install

    install(PERIOD)
