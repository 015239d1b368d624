"""The pacing of tests/paced/sitecustomize.py: each training step of this process starts at least
a period (PACED_STEP_SECONDS) after the previous one, through a global optimizer step pre-hook registered
when the program imports torch.optim.optimizer.
"""

import importlib.abc
import importlib.util
import sys
import time

_step = {"period": 0.0, "started": 0.0, "stepped": set()}


def _pace(optimizer, args, kwargs) -> None:
    """An optimizer that already stepped in this training step starts the next one: wait until
    the period has passed since this one started."""
    if id(optimizer) in _step["stepped"]:
        wait = _step["started"] + _step["period"] - time.monotonic()
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


def install(period: float) -> None:
    """Start this process's training steps ``period`` seconds apart from its first optimizer
    step on."""
    _step["period"] = period
    sys.meta_path.insert(0, _HookOnImport())
