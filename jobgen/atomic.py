"""Write-to-temp-then-rename for every file that matters.

A reader (another array task, another user's ``jobgen status``, a watchdog) sees
either the old file or the new one, never half of one, even if the writer is
killed mid-write or the node dies.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(target.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    write_bytes_atomic(path, text.encode(), mode)


def write_json_atomic(path: str | os.PathLike[str], data: Any, mode: int = 0o644) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename durable; some filesystems (NFS, Lustre) refuse fsync on directories."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
