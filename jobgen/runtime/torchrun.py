"""torchrun, as the batch script launches it on every node: torch's own launcher, whose process
ends when its work has ended.

    python -m jobgen.runtime.torchrun --nnodes=2 --nproc-per-node=4 ... --tee=3 -m trainer ...

The arguments are torchrun's, unchanged; the agent, the rendezvous and the workers are torch's.
What differs is the end. With ``--tee`` the agent copies each rank's log to its own output with
one thread per file. torch stops those threads at the end of ``PContext.close``; a SIGTERM that
arrives inside ``close`` (srun's --kill-on-bad-exit ends the other nodes' tasks this way when one
node's fails) raises out of it before that line, the threads keep polling files that will never
end, and the interpreter waits for them at exit: the agent outlives its workers until Slurm's
KillWait SIGKILLs it (30 s on the dev cluster, often 60 s or more on a site), and the next launch
waits as long. Reproduced with torch 2.13: two agents, rank 0's killed, SIGTERM to the other
0.8 s later: still alive after 120 s with ``--tee``, gone in 0.9 s without it
(tests/distributed/test_torchrun_exit.py).

So once torch's ``main`` has returned or raised, this process finishes what the interrupted close
left undone and leaves, with the code torchrun would have ended with: 0, the code of a
``SystemExit``, or 1 after the traceback of any other exception (torch's ``ChildFailedError`` and
``SignalException`` among them). What close left undone is the workers: they have had their
SIGTERM, and they get the rest of the time torch gives them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, the
batch script's job.exit_grace share) to save and exit before their process groups are SIGKILLed,
as close would have done; a further signal cuts that wait short. After a close that completed
there is no worker left and the process ends at once. Nothing of torch's runs after that point
but the tailers' threads, which hold nothing to save.

Inside a podman container the launch is tethered to the ``podman run`` that srun started
(:mod:`jobgen.runtime.tether`): when that process is gone, Slurm has SIGKILLed the step (its
SIGTERM, and the grace after it, came through podman's signal proxy before), and the workers and
this process are SIGKILLed at once, as Slurm's SIGKILL would have done without the container: the
step ends now, and the supervisor's next launch does not wait for it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from jobgen.runtime.tether import tether_here

# What torch's close gives the workers after their SIGTERM when the variable is unset.
DEFAULT_SHUTDOWN_SECONDS = 30.0
# After workers an interrupted close left have ended: the time torch's --tee threads (which poll
# each rank's file every 0.1 s) get to copy the workers' last lines before the process ends.
TAIL_DRAIN_SECONDS = 1.0


def exit_code(exc: SystemExit) -> int:
    """The status Python gives a process that ends with ``exc``: None is 0, an int itself, any
    other value (a message) printed to stderr and 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run(argv: list[str]) -> int:
    """Run torch's torchrun on ``argv`` and return the status it ends with."""
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SystemExit as exc:
        return exit_code(exc)
    except BaseException:  # noqa: BLE001 - the status and traceback torchrun's own end would give
        traceback.print_exc()
        return 1
    return 0


def children(parent: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes whose parent is ``parent`` (zombies included: they are reaped below)."""
    found = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while the directory was read
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            found.append(int(text.split(" ", 1)[0]))
    return sorted(found)


def reaped(pid: int) -> bool:
    """Whether child ``pid`` has ended (and is now reaped)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # not ours, or already reaped
        return True


class _Interrupted(Exception):
    """A further signal while the workers are given their time."""


def _interrupt(signum, frame) -> None:
    raise _Interrupted


def finish_workers(seconds: float) -> list[int]:
    """Wait up to ``seconds`` for this process's children (the workers an interrupted close left)
    to end, then SIGKILL the process groups of those still there; returns the ones killed."""
    alive = children(os.getpid())
    if not alive:
        return []
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), _interrupt)
    deadline = time.monotonic() + seconds
    try:
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if not reaped(pid)]
            if alive:
                time.sleep(0.1)
    except _Interrupted:
        alive = [pid for pid in alive if not reaped(pid)]
    for pid in alive:
        # torch starts each worker as the leader of its own process group: its children go with it.
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
                break
            except OSError:
                continue
        reaped(pid) or os.waitpid(pid, 0)
    return alive


def shutdown_seconds(environ: dict[str, str]) -> float:
    """The workers' time after their SIGTERM, as torch's close reads it."""
    try:
        return max(0.0, float(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_SECONDS)))
    except ValueError:
        return DEFAULT_SHUTDOWN_SECONDS


def leave(code: int) -> None:
    """End the process now: flush the streams and logging handlers, skip waiting for threads."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def on_untethered() -> None:
    """The step's ``podman run`` was SIGKILLed: end the launch as that SIGKILL would have."""
    workers = children(os.getpid())
    print(f"jobgen: the step's podman run was killed: SIGKILLing the workers {workers} and the agent", file=sys.stderr)
    for pid in workers:
        for kill in (os.killpg, os.kill):  # each worker leads its own process group
            try:
                kill(pid, signal.SIGKILL)
                break
            except OSError:
                continue
    leave(128 + signal.SIGKILL)


def main() -> None:
    code = 1
    try:
        tether_here(on_untethered)
        code = run(sys.argv[1:])
        left = children(os.getpid())
        killed = finish_workers(shutdown_seconds(dict(os.environ)))
        if killed:
            print(f"jobgen: workers {killed} outlived the agent's close and its grace: SIGKILLed", file=sys.stderr)
        if left:
            # Without this the workers' last lines ("saved", a traceback) reach their rank's log
            # file but not the node's output, which the batch log and `jobgen logs` read.
            time.sleep(TAIL_DRAIN_SECONDS)
    finally:
        leave(code)


if __name__ == "__main__":
    main()
