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

import importlib.abc
import importlib.util
import os
import sys
import time

PERIOD = float(os.environ.get("PACED_STEP_SECONDS") or 0)
_step = {"started": 0.0, "stepped": set()}


def _pace(optimizer, args, kwargs) -> None:
    """An optimizer that already stepped in this training step starts the next one: wait until
    PERIOD has passed since this one started."""
    if id(optimizer) in _step["stepped"]:
        wait = _step["started"] + PERIOD - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        _step["stepped"].clear()
    if not _step["stepped"]:
        _step["started"] = time.monotonic()
    _step["stepped"].add(id(optimizer))


class _HookOnImport(importlib.abc.MetaPathFinder):
    """Registers the pacing hook once the program imports torch.optim.optimizer itself: torch is
    not imported any earlier than the program would (the trainer sets up its allocator first)."""

    def find_spec(self, name, path, target=None):
        if name != "torch.optim.optimizer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def run_then_hook(module) -> None:
            run(module)
            module.register_optimizer_step_pre_hook(_pace)

        spec.loader.exec_module = run_then_hook
        return spec


if PERIOD > 0 and os.environ.get("RANK") is not None:
    sys.meta_path.insert(0, _HookOnImport())
