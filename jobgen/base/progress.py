"""Progress on the long waits: one line on the terminal, redrawn in place, with what is done,
the rate measured so far and the time left at that rate. Off a terminal (a pipe, a log
file, a job's output) it prints nothing: a script gets the command's result, not a stream
of carriage returns.

    progress = Progress("export", total=nbytes, unit="B")
    progress.advance(n)   # as work is done
    progress.close()      # the final state, then a newline

Imports nothing heavy: the CLI uses it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

# Redraw at most this often: a terminal needs no more, and a tight loop pays nothing.
REDRAW_SECONDS = 0.2
BAR_WIDTH = 24


def human_count(value: float, unit: str) -> str:
    """``1.5 GB`` for bytes (unit "B"), ``12,345 rows`` otherwise."""
    if unit == "B":
        for suffix, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if value >= size:
                return f"{value / size:.1f} {suffix}"
        return f"{value:.0f} B"
    return f"{value:,.0f}{' ' + unit if unit else ''}"


def human_seconds(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """One task's progress (see the module docstring). ``total`` None: no bar and no ETA,
    only what is done, the rate and the time so far."""

    def __init__(
        self,
        label: str,
        total: float | None = None,
        unit: str = "",
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.started = clock()
        self.done = 0.0
        self.status = ""
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn_at: float | None = None
        self._width = 0

    def advance(self, amount: float = 1) -> None:
        self.done += amount
        self._maybe_draw()

    def update(self, done: float | None = None, status: str | None = None) -> None:
        """Set what is done, and a word on where things stand ("pending (Priority)")."""
        if done is not None:
            self.done = done
        if status is not None:
            self.status = status
        self._maybe_draw()

    def line(self) -> str:
        elapsed = self.clock() - self.started
        parts = [self.label]
        if self.total:
            fraction = min(1.0, self.done / self.total)
            filled = int(fraction * BAR_WIDTH)
            parts.append("[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]")
            parts.append(f"{human_count(self.done, self.unit)} / {human_count(self.total, self.unit)}")
        elif self.done:
            parts.append(human_count(self.done, self.unit))
        if self.done and elapsed > 0:
            rate = self.done / elapsed
            parts.append(f"{human_count(rate, self.unit)}/s")
            if self.total and self.done < self.total:
                parts.append(f"ETA {human_seconds((self.total - self.done) / rate)}")
        finished = bool(self.total) and self.done >= self.total
        parts.append(f"done in {human_seconds(elapsed)}" if finished else f"{human_seconds(elapsed)} so far")
        if self.status:
            parts.append(self.status)
        return "  ".join(p for p in parts if p)

    def _maybe_draw(self, force: bool = False) -> None:
        if not self.live:
            return
        now = self.clock()
        if not force and self._drawn_at is not None and now - self._drawn_at < REDRAW_SECONDS:
            return
        self._drawn_at = now
        text = self.line()
        # Pad over what a longer previous line left on the terminal.
        self.stream.write("\r" + text + " " * max(0, self._width - len(text)))
        self.stream.flush()
        self._width = len(text)

    def close(self) -> None:
        """Draw the final state and end the line (on a terminal; nothing otherwise)."""
        if self.live:
            self._maybe_draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
