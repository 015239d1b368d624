"""One writer per run directory: an exclusive ``flock`` on ``<run>/writer.lock``.

The trainer's rank 0 takes the lease before it touches anything (stale ``.tmp-*``
saves, checkpoints, metrics) and holds it until the process ends; the kernel
releases it however the process ends, SIGKILL included, and an NFS client's lock
goes with its lease when a node dies. A second writer (a second ``jobgen submit``
racing the first, ``submit --local`` next to a queued job, a hand-started
``torchrun -m trainer``) is refused with the holder's description, which the holder
writes into the lock file once it has the lock.

``jobgen submit`` asks :func:`holder` before it queues anything, so a run that a
process is already writing is refused at submission, not at the job's start.

:func:`exclusive` is the same kernel lock for a short critical section: waited for, held for
the block, released after it (a sweep's claims, a Slurm build in the dev cluster's cache).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import getpass
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class RunBusy(RuntimeError):
    """Another process holds the run's writer lease; the message names it."""

    def __init__(self, path: Path, holder: str):
        self.path = path
        self.holder = holder
        super().__init__(
            f"{path.parent} is being written by {holder or 'another process'} "
            f"(it holds {path.name}); wait for it to end or stop it first"
        )


def describe_self() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    restart = os.environ.get("SLURM_RESTART_COUNT") or "0"
    where = f"job {job} (restart {restart})" if job else "a process outside Slurm"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    since = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    return f"{where}, pid {os.getpid()} on {socket.gethostname()} as {user} since {since}"


class WriterLease:
    """Held from :meth:`acquire` until :meth:`release` or the end of the process."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lease now or raise :class:`RunBusy`; never waits."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunBusy(self.path, holder) from None
        except BaseException:
            os.close(fd)
            raise
        # Only the holder writes the description, so a reader never sees a rival's.
        os.ftruncate(fd, 0)
        os.pwrite(fd, (describe_self() + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> WriterLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def holder(path: Path) -> str | None:
    """Who holds the lease at ``path`` now, or None when nobody does (a probe: it takes
    the lock for an instant if it is free, and releases it at once)."""
    if not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or "another process"
    finally:
        os.close(fd)
    return None


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing) for the block, waiting for it."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
