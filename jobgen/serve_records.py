"""Reading the serve records back: ``serve-job.json`` and ``serve.json`` are input like any file.

    read_record(run.serve_job)   # -> dict, None when there is none, or RecordError naming the file

jobgen writes both atomically as small regular files. What is found there may be something
else: truncated, another JSON type, nested past the parser's recursion, a link to
``/dev/zero``, a FIFO nobody writes. Each is a :class:`RecordError` whose message names the
file in one line; nothing blocks, and nothing big is read.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

# A serve record is a few hundred bytes; a bigger file is no record of jobgen's.
MAX_RECORD_BYTES = 1 << 20


class RecordError(ValueError):
    """A serve record that exists and cannot be read; the message names the file."""


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file."""
    try:
        # No link is followed (jobgen writes none) and a FIFO does not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "a symbolic link (jobgen writes none there)" if exc.errno == errno.ELOOP else exc.strerror
        raise RecordError(f"{path} is unreadable: {why}") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise RecordError(f"{path} is unreadable: not a regular file")
        data = fh.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{path} is unreadable: over {MAX_RECORD_BYTES} bytes, no serve record")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise RecordError(f"{path} is unreadable: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(value, dict):
        raise RecordError(f"{path} is unreadable: a JSON {type(value).__name__}, not an object")
    return value
