"""Write-to-temp-then-rename for every file that matters.

A reader (another array task, another user's ``jobgen status``, a watchdog) sees
either the old file or the new one, never half of one, even if the writer is
killed mid-write or the node dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike[str], mode: int = 0o755) -> Iterator[Path]:
    """Fill a directory under a temporary name next to ``target``, then rename it into
    place: ``target`` is complete or absent, never half-written. An empty ``target`` is
    replaced; a non-empty one is an error. On any exception the staging directory goes."""
    target = Path(target)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".staging", dir=target.parent))
    try:
        yield staging
        staging.chmod(mode)  # mkdtemp's 0700 would hide the result from the team
        if target.exists():
            target.rmdir()
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(target.parent)
