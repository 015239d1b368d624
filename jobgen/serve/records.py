"""The serve records on disk, and the process a ``--local`` record names: input, never trusted.

    read_record(run.serve_job)                      # -> dict, None when there is none, or RecordError
    identity(proc.pid)                              # -> {"pid", "started", "boot_id"}: recorded at start
    why_not_ours(state, record, script)             # -> None, or NotOurs: why the pid is not jobgen's script
    signal_if_ours(state, record, script, SIGTERM)  # -> None when signalled, else NotOurs

jobgen writes ``serve-job.json`` and ``serve.json`` atomically as small regular files. What
is found there may be something else: truncated, another JSON type, nested past the parser's
recursion, a link to ``/dev/zero``, a FIFO nobody writes. Each is a :class:`RecordError` whose
message names the file in one line; nothing blocks, and nothing big is read.

``jobgen serve RUN --local`` records the pid of the serve script it starts; ``--status`` and
``--stop`` read it back. A pid alone names nothing for long: once the script has ended the
kernel gives the number to the next process, and the record is a file anyone with write
access may have edited. So a pid is taken for the script only when everything jobgen
recorded still holds: the same boot, the same start time (field 22 of ``/proc/PID/stat``,
clock ticks after boot: a reused pid starts later), and the command line ``bash <this
directory's serve.sbatch>``. The signal goes through a pidfd opened before those checks, so
the process checked is the process signalled.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobgen.base.safe_read import DamagedFile, parse_json, read_bytes
from jobgen.base.visible import visible
from jobgen.runs.rundir import RunDir

# A serve record is a few hundred bytes; a bigger file is no record of jobgen's.
MAX_RECORD_BYTES = 1 << 20


class RecordError(ValueError):
    """A serve record that exists and cannot be read; the message names the file."""


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file."""
    try:  # a regular file only, bounded, never a link, a FIFO or a device (jobgen.base.safe_read)
        value = parse_json(path, read_bytes(path, MAX_RECORD_BYTES))
    except FileNotFoundError:
        return None
    except DamagedFile as exc:
        raise RecordError(f"{visible(path)} is unreadable: {visible(exc.problem)}") from None
    if not isinstance(value, dict):
        raise RecordError(f"{path} is unreadable: a JSON {type(value).__name__}, not an object")
    return value


# ---------------------------------------------------------------- the process a record names

# The kernel's largest pid_max (PID_MAX_LIMIT on 64-bit): a bigger number is no pid. Below 2,
# os.kill would signal a process group or every process of the user.
PID_MAX = 4 * 1024 * 1024
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class NotOurs:
    """Why a record's pid is not taken for the server's script: ``gone`` when the script has
    simply ended (the usual end), else the record or the process does not match."""

    reason: str
    gone: bool = False

    def __str__(self) -> str:
        return self.reason


def _stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and start time (clock ticks after boot); None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        # The command name (field 2) is in parentheses and may hold spaces and ')': fields
        # after the last ')' start at field 3, so the state is the 1st and field 22 the 20th.
        fields = text[text.rindex(")") + 1 :].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; None when there is none."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def boot_id() -> str | None:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return None


def identity(pid: int) -> dict[str, Any]:
    """What a record needs to name process ``pid`` beyond doubt later."""
    return {"pid": pid, "started": process_start(pid), "boot_id": boot_id()}


def same_path(recorded: object, expected: Path) -> bool:
    """Whether ``recorded`` (from a file) names ``expected``: the same text, or the same file."""
    if not isinstance(recorded, str) or not recorded:
        return False
    if recorded == str(expected):
        return True
    try:
        return os.path.samefile(recorded, expected)
    except (OSError, ValueError):
        return False


def valid_pid(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 1 < value <= PID_MAX:
        return value
    return None


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="surrogateescape") for part in raw.split(b"\0")[:-1]]


def why_not_ours(state: RunDir, record: dict[str, Any], script: Path) -> NotOurs | None:
    """None when the record's pid is the serve script jobgen started for ``state`` (``script``
    is that directory's serve.sbatch) and it still runs; else why it is not."""
    pid = valid_pid(record.get("pid"))
    if pid is None:
        return NotOurs(f"{state.serve_job} names no valid pid ({str(record.get('pid'))[:40]!r})")
    started = record.get("started")
    if not isinstance(started, int) or isinstance(started, bool):
        return NotOurs(f"{state.serve_job} records no start time for pid {pid}, so it cannot tell that process apart")
    if record.get("boot_id") != boot_id():
        return NotOurs(f"pid {pid} was recorded before this machine last started", gone=True)
    if not same_path(record.get("script"), script):
        return NotOurs(f"{state.serve_job} names another script than {script}")
    stat = _stat(pid)
    if stat is None or stat[0] == "Z":
        return NotOurs(f"pid {pid} has exited", gone=True)
    if stat[1] != started:
        return NotOurs(f"pid {pid} is another process than the one jobgen started, which has ended", gone=True)
    if _cmdline(pid) != ["bash", str(record["script"])]:
        return NotOurs(f"pid {pid} runs another command than bash {record['script']}")
    return None


def signal_if_ours(state: RunDir, record: dict[str, Any], script: Path, signum: int) -> NotOurs | None:
    """Send ``signum`` to the record's process if it is provably ours; None when sent, else why not.
    The pidfd is opened first: a process that ends after the checks cannot pass its number on
    to the one that gets the signal."""
    pid = valid_pid(record.get("pid"))
    if pid is None:
        return why_not_ours(state, record, script)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return NotOurs(f"pid {pid} has exited", gone=True)
    except (AttributeError, OSError):
        pidfd = None  # no pidfds on this kernel: check, then signal by number
    try:
        why = why_not_ours(state, record, script)
        if why is not None:
            return why
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            return NotOurs(f"pid {pid} has exited", gone=True)
        return None
    finally:
        if pidfd is not None:
            os.close(pidfd)
