"""The hang watch of one launch (train.hang_timeout): each rank keeps a heartbeat file from its
first step on (:mod:`jobgen.runs.heartbeat`) and removes it while it saves. When files exist and
none changed for the timeout, no rank is taking steps (in synchronous training every rank waits
for the slowest): the supervisor takes every rank's stacks, kills the launch, and the relaunch
resumes from the newest state. A rank that hangs before its first step meets the collective
timeout instead.

"Now" is read by the clock that stamps the heartbeats: the modification time of a new file made
in the directory (a shared filesystem's server may run minutes off this node's clock).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from jobgen.base.owned_dir import OwnedDir
from jobgen.runs.heartbeat import beats


def quiet_for(newest_beat: float | None, now: float | None) -> float | None:
    """Seconds since the newest heartbeat; None when there is nothing to judge (no rank has a
    file: before the first step, or every rank is saving) or the clock cannot be read."""
    if newest_beat is None or now is None:
        return None
    return now - newest_beat


def is_hung(quiet: float | None, timeout: int) -> bool:
    return quiet is not None and quiet >= timeout


def hang_words(step: int | None, timeout: int, stacks: Path) -> str:
    at = step if step is not None else "unknown"
    return f"hung: no rank took a step for {timeout} s after step {at} (train.hang_timeout); stacks in {stacks}"


@dataclass
class HangWatch:
    """Looks at one launch's heartbeat directory every ``every`` seconds."""

    directory: Path
    timeout: int
    every: float
    next_look: float = 0.0

    def prepare(self) -> bool:
        """The launch's own directory, 0755 whatever the umask (the ranks keep heartbeats only in
        a directory no one else may write). False: it cannot be made, and this launch is not watched."""
        try:
            OwnedDir.ensure(self.directory, 0o755).close()
        except OSError:
            return False
        self.next_look = time.monotonic() + self.every
        return True

    def due(self, monotonic: float) -> bool:
        if monotonic < self.next_look:
            return False
        self.next_look = monotonic + self.every
        return True

    def look(self) -> tuple[float | None, int | None]:
        """(seconds since the newest beat, the newest step): one listing, so a rank that removes
        its file meanwhile (a save begins) is simply not in it. Only this user's regular files count."""
        try:
            found = beats(self.directory)
        except OSError:
            return None, None
        if not found:
            return None, None
        newest = max(beat.mtime for beat in found)
        return quiet_for(newest, self._filesystem_now()), max(beat.step for beat in found)

    def _filesystem_now(self) -> float | None:
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            # A new file (O_EXCL: never through a link put at its name), stamped by the server, removed at once.
            name = f".watch.{os.getpid()}.{time.monotonic_ns()}"
            file = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
            try:
                return os.fstat(file).st_mtime
            finally:
                os.close(file)
                os.unlink(name, dir_fd=fd)
        except OSError:
            return None
        finally:
            os.close(fd)
