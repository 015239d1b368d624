"""Each rank's heartbeat: a small file the job's supervisor watches to tell a hung launch from a
slow one (train.hang_timeout, where job.in_job_restarts relaunches the trainer).

The job's supervisor exports ``JOBGEN_HEARTBEAT_DIR`` (one directory per launch of a task:
``RunDir.heartbeats``) and ``JOBGEN_HEARTBEAT_SECONDS`` (how often a rank writes at most).
Each rank keeps ``rank-<N>`` there, holding the step it last finished; its modification time
is when. The job's supervisor (:mod:`jobgen.job.hang_watch`) calls the launch hung when files
exist and none changed for the hang timeout: in synchronous
training every rank waits for the slowest, so one stuck rank stops them all.

A rank removes its file while it does something long that is no step (a checkpoint save, the
final export, the time after training): with no file to judge, nothing is called hung. So a
rank's heartbeat starts at its first step (:meth:`Heartbeat.beat`), never during loading.

A rank's main thread only counts its beats; a daemon thread writes the file at most every
``JOBGEN_HEARTBEAT_SECONDS``, to a temporary name renamed into place (the watcher never reads
half a number), not fsynced: a heartbeat is worth nothing after a crash.

The directory may sit where teammates can write (a run directory under umask 002). So a rank
opens it once, as its own (:class:`jobgen.base.owned_dir.OwnedDir`: no link followed, the
user's, writable by no one else; the supervisor makes it 0755 whatever the umask), and
writes, renames and removes its files only relative to it, creating the temporary file with
``O_EXCL | O_NOFOLLOW``: a link planted at ``rank-N`` or ``.rank-N.tmp`` is replaced or removed
as itself, never written through. A directory it cannot trust is said once in the rank's log
and the rank keeps no heartbeat (the collective timeout still ends a hang).

The step the ranks last finished (what a hang is reported at), by hand or from a script queued by an older jobgen:

    python -m jobgen.runs.heartbeat DIR     # prints the newest step of this user's rank-* files

which reads them as any file of a run is read (no link followed, no FIFO waited on, a
bounded size): a planted file neither hangs the watcher nor is taken for a rank's.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from jobgen.base.owned_dir import OwnedDir

DIR_ENV = "JOBGEN_HEARTBEAT_DIR"
SECONDS_ENV = "JOBGEN_HEARTBEAT_SECONDS"
FILE_PREFIX = "rank-"


def interval_for(hang_timeout: int) -> int:
    """How often a rank writes its heartbeat at most, and how often the supervisor looks:
    a tenth of the hang timeout (a hang is called at most two of them late), not more than
    once a second nor less than every 30 s (a shared filesystem gets one small rename per
    rank per interval)."""
    return max(1, min(30, hang_timeout // 10))


class Heartbeat:
    """One rank's heartbeat file. :meth:`beat` only counts (no I/O on the training path); a
    daemon thread writes the file every ``every`` seconds when the count moved since its last
    write, with the newest step. A rank stuck anywhere (in a collective, a read, a C call that
    holds the GIL) stops counting, the file stops changing, and after a hang the file holds
    the exact step the rank last finished (the thread's one write after the last beat)."""

    def __init__(self, directory: Path, rank: int, every_seconds: float):
        self.path = directory / f"{FILE_PREFIX}{rank}"
        self._name = self.path.name
        self._tmp = f".{FILE_PREFIX}{rank}.tmp"
        self._directory: OwnedDir | None = None  # opened at the first write
        self._refused = False
        self.every = every_seconds
        self._beats = 0  # marks of progress so far
        self._written = 0  # the count the file was last written at (0: none since a pause)
        self._step: int | None = None
        self._paused = False
        # The writer never recreates the file once pause() removed it: both hold this lock.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jobgen-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, rank: int) -> Heartbeat | None:
        """The heartbeat the supervisor asks for, or None (no hang watch on this launch)."""
        directory, every = os.environ.get(DIR_ENV), os.environ.get(SECONDS_ENV)
        if not directory or not every:
            return None
        try:
            seconds = float(every)
        except ValueError:
            return None
        return cls(Path(directory), rank, seconds) if seconds > 0 else None

    def beat(self, step: int | None = None) -> None:
        """This rank made progress (finished ``step``, or an evaluation batch when None)."""
        if step is not None:
            self._step = step
        self._paused = False
        self._beats += 1

    def pause(self) -> None:
        """Something long that is not a step follows (a save, the end of training): the file
        goes, and the watcher judges nothing until the next :meth:`beat` is written."""
        with self._lock:
            self._paused = True
            self._written = 0
            if self._directory is not None:
                with contextlib.suppress(OSError):
                    self._directory.unlink(self._name)  # a link there goes as itself

    def close(self) -> None:
        """Pause for good and end the writer thread."""
        self.pause()
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self.every))
        with self._lock:
            if self._directory is not None:
                self._directory.close()
                self._directory = None

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._write_if_moved()

    def _write_if_moved(self) -> None:
        """One write when beats came since the last one. A filesystem error is ignored: a
        heartbeat that cannot be written makes the watcher wait longer, and the collective
        timeout still ends a real hang."""
        with self._lock:
            beats = self._beats
            if self._paused or beats == self._written:
                return
            directory = self._open_directory()
            if directory is None:
                return
            try:
                with contextlib.suppress(FileNotFoundError):
                    directory.unlink(self._tmp)  # one a killed write left, or a planted link
                fd = directory.open_file(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, f"{self._step if self._step is not None else ''}\n".encode())
                finally:
                    os.close(fd)
                directory.rename(self._tmp, self._name)
            except OSError:
                return
            self._written = beats

    def _open_directory(self) -> OwnedDir | None:
        """The launch's heartbeat directory, opened and checked once (module docstring)."""
        if self._directory is None and not self._refused:
            try:
                self._directory = OwnedDir.ensure(self.path.parent, 0o755)
            except OSError as exc:  # UntrustedDirectory included: said once, then no heartbeat
                self._refused = True
                print(f"jobgen: rank keeps no heartbeat: {exc}", file=sys.stderr, flush=True)
        return self._directory


# A heartbeat holds one step number and a newline; more is no heartbeat of a rank's.
MOST_BYTES = 32


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat as read: the step it last finished and when (the file's mtime)."""

    step: int
    mtime: float


def beats(directory: Path) -> list[Beat]:
    """The user's own regular ``rank-*`` files of ``directory`` that hold a step. Opened relative
    to the directory, never through a link, never waiting on a FIFO; a file of another user's,
    or one that holds no step, is not counted."""
    found = []
    with OwnedDir.open(directory) as opened:
        for name in opened.names():
            if not name.startswith(FILE_PREFIX):
                continue
            try:
                fd = opened.open_file(name, os.O_RDONLY)
            except OSError:
                continue  # a link (ELOOP), gone meanwhile
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    continue
                text = os.read(fd, MOST_BYTES + 1)
            finally:
                os.close(fd)
            word = text.strip()
            if len(text) <= MOST_BYTES and word.isdigit():
                found.append(Beat(int(word), st.st_mtime))
    return found


def newest_step(directory: Path) -> int | None:
    """The newest step in the user's own ``rank-*`` files of ``directory`` (None when none holds one)."""
    steps = [beat.step for beat in beats(directory)]
    return max(steps) if steps else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m jobgen.runs.heartbeat DIR", file=sys.stderr)
        return 2
    try:
        step = newest_step(Path(args[0]))
    except OSError as exc:  # UntrustedDirectory included: one line
        print(f"jobgen: {exc}", file=sys.stderr)
        return 1
    print("" if step is None else step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
