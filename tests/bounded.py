"""A reader run with bounds: in a forked child, under a time limit and an address-space limit
(``ulimit -v``) of what the process already maps plus an allowance, so a test sees a reader
that hangs (a FIFO, a lock) or allocates what a hostile file says (a length of 10**11, a link
to /dev/zero) fail, instead of the suite hanging or the machine swapping.

    outcome = bounded(lambda: Examples.open(entry), seconds=10, extra_bytes=256 << 20)
    assert outcome.error_type == "DataCacheError", outcome

The child is forked after the caller's imports (torch maps gigabytes of address space it never
touches: a limit set before its import would refuse the import itself), so the limit counts
only what the reader adds. What the child returns or raises comes back as text: the
exception's class name and ``str()``, or ``repr`` of the value.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# What a reader may allocate beyond what the process maps already, unless a test says otherwise.
DEFAULT_EXTRA_BYTES = 512 << 20


@dataclass(frozen=True)
class Outcome:
    """How the reader ended: ``value`` (repr) when it returned, else ``error_type`` and
    ``error`` (its message); ``hung`` when the time limit killed it, ``signal`` when a signal
    did (SIGBUS for a read past a mapped file's end), ``traceback`` for a failed test's text."""

    value: str | None = None
    error_type: str | None = None
    error: str | None = None
    hung: bool = False
    signal: int | None = None
    traceback: str = ""

    @property
    def returned(self) -> bool:
        return self.error_type is None and not self.hung and self.signal is None


def _mapped_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def bounded(reader: Callable[[], Any], *, seconds: float = 20, extra_bytes: int = DEFAULT_EXTRA_BYTES) -> Outcome:
    """Run ``reader()`` in a forked child with at most ``seconds`` of wall time and
    ``extra_bytes`` of address space beyond the parent's; its :class:`Outcome`."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        try:
            limit = _mapped_bytes() + extra_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            signal.alarm(max(1, int(seconds + 0.999)))
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            try:
                outcome = Outcome(value=repr(reader())[:2000])
            except BaseException as exc:  # noqa: BLE001 - what the reader raised is the outcome
                outcome = Outcome(
                    error_type=type(exc).__name__, error=str(exc)[:4000], traceback=traceback.format_exc()
                )
            data = pickle.dumps(outcome)
            view = memoryview(data)
            while view:
                view = view[os.write(write_end, view) :]
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as fh:
        while chunk := fh.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        return Outcome(hung=number == signal.SIGALRM, signal=None if number == signal.SIGALRM else number)
    if not chunks:
        return Outcome(error_type="NoOutcome", error=f"the child exited {os.waitstatus_to_exitcode(status)} silently")
    return pickle.loads(b"".join(chunks))  # written by our own child above, never read from disk
