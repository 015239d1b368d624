"""Each rank's heartbeat: a small file the batch script watches to tell a hung launch from a
slow one (train.hang_timeout, where job.in_job_restarts relaunches the trainer).

The batch script exports ``JOBGEN_HEARTBEAT_DIR`` (one directory per launch of a task:
``RunDir.heartbeats``) and ``JOBGEN_HEARTBEAT_SECONDS`` (how often a rank writes at most).
Each rank keeps ``rank-<N>`` there, holding the step it last finished; its modification time
is when. The watcher in the batch script (``watch_heartbeats``, sbatch_templates/_launch.j2)
calls the launch hung when files exist and none changed for the hang timeout: in synchronous
training every rank waits for the slowest, so one stuck rank stops them all.

A rank removes its file while it does something long that is no step (a checkpoint save, the
final export, the time after training): with no file to judge, nothing is called hung. So a
rank's heartbeat starts at its first step (:meth:`Heartbeat.beat`), never during loading.

A rank's main thread only counts its beats; a daemon thread writes the file at most every
``JOBGEN_HEARTBEAT_SECONDS``, to a temporary name renamed into place (the watcher never reads
half a number), not fsynced: a heartbeat is worth nothing after a crash.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

DIR_ENV = "JOBGEN_HEARTBEAT_DIR"
SECONDS_ENV = "JOBGEN_HEARTBEAT_SECONDS"
FILE_PREFIX = "rank-"


def interval_for(hang_timeout: int) -> int:
    """How often a rank writes its heartbeat at most, and how often the batch script looks:
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
        self._tmp = directory / f".{FILE_PREFIX}{rank}.tmp"
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
        """The heartbeat the batch script asks for, or None (no hang watch on this launch)."""
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
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                pass

    def close(self) -> None:
        """Pause for good and end the writer thread."""
        self.pause()
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self.every))

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
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._tmp.write_text(f"{self._step if self._step is not None else ''}\n")
                os.replace(self._tmp, self.path)
            except OSError:
                return
            self._written = beats
