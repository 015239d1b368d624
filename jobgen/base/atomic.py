"""Write-to-temp-then-rename for every file that matters.

A reader (another array task, another user's ``jobgen status``, a watchdog) sees
either the old file or the new one, never half of one, even if the writer is
killed mid-write or the node dies.

Permissions are the user's: ``mode`` is what is asked of the kernel when the file or
directory is created, and the kernel takes the umask (and any default ACL) off it,
exactly as for ``open``/``mkdir``. A user with umask 022 gets 0644 files that the
team can read but not replace; one with umask 002 asked for group-write. (tempfile's
0600/0700 would need a chmod afterwards, and a chmod ignores both.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class TargetExists(FileExistsError):
    """The name :func:`staged_directory` was to publish is already a non-empty directory:
    someone had it first, or another process renamed its own staging into it meanwhile."""


def _create_unique(directory: Path, prefix: str, suffix: str, create: Callable[[str], T]) -> tuple[T, str]:
    """``create(name)`` for a fresh random name in ``directory``, as tempfile picks them."""
    for _ in range(100):
        name = str(directory / f"{prefix}{secrets.token_hex(4)}{suffix}")
        try:
            return create(name), name
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary name {prefix}*{suffix} in {directory}")


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data``; ``mode`` before the umask (0o777 for a script)."""
    target = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd, tmp = _create_unique(target.parent, f".{target.name}.", ".tmp", lambda name: os.open(name, flags, mode))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(target.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str, mode: int = 0o666) -> None:
    write_bytes_atomic(path, text.encode(), mode)


def write_json_atomic(path: str | os.PathLike[str], data: Any, mode: int = 0o666) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode)


def current_umask() -> int:
    """This process's umask, read without changing it (Linux /proc). ``os.umask`` reads it
    only by setting it, which races with any thread creating a file meanwhile; the
    fallback sets the strictest mask for that instant, never a looser one."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


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


def fsync_tree(directory: str | os.PathLike[str]) -> None:
    """Every file and directory under ``directory`` durable: what a rename that publishes the
    directory needs first, or a node crash could leave the published name with lost files."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike[str], mode: int = 0o777) -> Iterator[Path]:
    """Fill a directory under a temporary name next to ``target``, then rename it into
    place: ``target`` is complete or absent, never half-written. An empty ``target`` is
    replaced; a non-empty one is an error. Every file is fsynced before the rename. On any
    exception the staging directory goes.
    ``mode`` is before the umask, as for ``mkdir``."""
    target = Path(target)
    if target.exists() and any(target.iterdir()):
        raise TargetExists(f"{target} exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    _, name = _create_unique(target.parent, f".{target.name}.", ".staging", lambda name: os.mkdir(name, mode))
    staging = Path(name)
    try:
        yield staging
        fsync_tree(staging)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(target.parent)


def _publish(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``. A process that filled its own staging directory at
    the same time may have renamed it in first: then the kernel refuses ours (ENOTEMPTY, or
    EEXIST on some filesystems), and that is :class:`TargetExists`, not a bare OSError."""
    try:
        with contextlib.suppress(FileNotFoundError):  # an empty target someone removed: the rename needs none
            if target.exists():
                target.rmdir()
        staging.rename(target)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise TargetExists(f"{target} was created by another process meanwhile") from None
        raise
