"""A step's tether to the process Slurm knows it by, for a container runtime whose processes
leave Slurm's process tree (podman: ``podman run`` hands the container to conmon, which is
nobody's child of slurmstepd's). Slurm ends a step by signalling the processes it tracks: the
SIGTERM reaches the container through podman's signal proxy, but a SIGKILL (KillWait's, or
``scancel --signal=KILL``) ends only ``podman run``, and the container would train on, holding
the node's port and GPUs, while the next launch starts beside it. Measured on the dev cluster
(podman 4.3, proctrack/linuxproc): the container's processes outlived the job by minutes.

The step's shell execs ``podman run --env=JOBGEN_TETHER_PID=$$``, so the variable holds the pid
of the process Slurm tracks; with ``--pid=host`` it is the same pid inside. :func:`watch` polls
it (and its start time, so a reused pid is no reprieve) and calls back once it has gone; the
torchrun wrapper (:mod:`jobgen.runtime.torchrun`) then ends the launch as a SIGTERM would.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from jobgen.spec.containers import TETHER_ENV

POLL_SECONDS = 1.0


def start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The start time of ``pid`` (clock ticks after boot, /proc/<pid>/stat's 22nd field), or
    None when no such process lives."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    try:
        state, started = fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None
    return None if state in ("Z", "X") else started


def tethered_pid(environ: Mapping[str, str]) -> int | None:
    """The pid the step is tethered to, when its runtime set one."""
    value = environ.get(TETHER_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def watch(
    pid: int, on_lost: Callable[[], None], *, poll: float = POLL_SECONDS, proc: Path = Path("/proc")
) -> threading.Thread | None:
    """Call ``on_lost`` once, from a daemon thread, when ``pid`` has ended (or another process
    took its pid). None, and no thread, when ``pid`` is not there to begin with: a step started
    without the tether's runtime (its variable came in from elsewhere) is not ended for it."""
    started = start_time(pid, proc)
    if started is None:
        return None

    def poll_until_lost() -> None:
        while start_time(pid, proc) == started:
            time.sleep(poll)
        on_lost()

    thread = threading.Thread(target=poll_until_lost, name=f"jobgen-tether-{pid}", daemon=True)
    thread.start()
    return thread


def tether_here(on_lost: Callable[[], None], environ: Mapping[str, str] | None = None) -> threading.Thread | None:
    """:func:`watch` the pid this process's environment names, if any."""
    pid = tethered_pid(os.environ if environ is None else environ)
    return watch(pid, on_lost) if pid else None
