"""A SIGTERMed test session unwinds as Ctrl-C does (a pytest plugin; tests/conftest.py uses it).

Killed by a CI runner's timeout or by ``kill``, pytest died at once: the running test's
``finally`` blocks and the fixtures' teardowns never ran, so a dev cluster kept with
JOBGEN_KEEP_CLUSTER=1 stayed with the slurm.conf one test had changed (helpers.slurm_setting's
SlurmdTimeout=300) and every later session on it found lost nodes 5 minutes late. With this the
signal raises KeyboardInterrupt in the session's own process: the test stops where it is, its
clean-up and its fixtures' run, and pytest reports the interruption. A process forked from the
session (multiprocessing's fork) dies of the signal as before, unless it comes in the instant
after fork(), before the child runs Python again: Python drops a Python handler's pending signals
there.

    python -m pytest -p unwind ...   (tests/ on sys.path)
"""

from __future__ import annotations

import os
import signal

_SESSION_PID: list[int] = []


def _unwind(signum: int, frame: object) -> None:
    if os.getpid() not in _SESSION_PID:  # a forked child: die of the signal, as without this handler
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"pytest got signal {signal.Signals(signum).name}")


def install() -> None:
    """Make SIGTERM unwind this process (the session's, or an xdist worker's)."""
    _SESSION_PID[:] = [os.getpid()]
    signal.signal(signal.SIGTERM, _unwind)


def pytest_configure(config) -> None:
    install()
