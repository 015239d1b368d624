"""Directories in places others can write, held as the user's own: opened once, checked, and
then only ever used through their file descriptor.

A runs root, a data cache or a node's /dev/shm is shared: a teammate (or anyone, in /dev/shm)
may create a name before jobgen does, or swap one for a link between two of its calls. A
path looked up twice may name two different things. So a directory jobgen writes into is
opened once (``O_DIRECTORY | O_NOFOLLOW``: a link at its name is refused, never followed), its
owner and mode checked on that open descriptor (:func:`check_trust`), and everything inside it
is made, opened, renamed and removed relative to that descriptor, never again by path. A
rename or a link planted at the directory's name after the open cannot redirect a write, a
delete or a chmod: the descriptor still names the directory that was checked.

Two kinds of trust (:class:`Sharing`):

- ``PRIVATE``: the user's own. Its owner is the user and no one else may write it (no group or
  other write bit). jobgen makes such a directory with exactly ``mode`` whatever the umask.
- ``GROUP``: a directory a site shares on purpose with a group (``paths.data_cache``). It may be
  group-writable only with both the setgid bit (files stay in the group) and the sticky bit (a
  member cannot rename or delete another member's files: without it, any member could move a
  build's staging directory aside and put a link to one of yours in its place); writable by
  everyone, never. Its owner may be another member or root.

Library code that only takes paths (``datasets``' ``save_to_disk``) is given :meth:`OwnedDir.pinned`:
``/proc/<pid>/fd/<fd>``, a name the kernel resolves to the opened directory itself, in this
process and in the children it forks. Standard library only (``jobgen/base``).
"""

from __future__ import annotations

import enum
import os
import pwd
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from jobgen.base.visible import visible

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Sharing(enum.Enum):
    """Who besides the user may write the directory (module docstring)."""

    PRIVATE = "private"
    GROUP = "group"


class UntrustedDirectory(PermissionError):
    """A directory jobgen was to write into (or read as its own) that someone else could have
    prepared: a link at its name, not a directory, another owner, or a mode that lets others
    write it. ``str()`` is one line naming the directory, what is wrong and what to do."""

    def __init__(self, path: Path | str, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{visible(path)}: {visible(problem)}")

    def __str__(self) -> str:  # PermissionError's own str() would show (errno, strerror)
        return self.args[0]


def owner_name(uid: int) -> str:
    """The account name of ``uid`` for a message, or "uid N" where this host has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # an id with no name on this host (another site's NFS)
        return f"uid {uid}"


def check_trust(st: os.stat_result, path: Path, sharing: Sharing) -> None:
    """Raise :class:`UntrustedDirectory` unless ``st`` (an fstat of an opened directory) is
    one the user may trust as ``sharing`` says."""
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedDirectory(path, "is not a directory")
    if sharing is Sharing.PRIVATE:
        if st.st_uid != me:
            owner = owner_name(st.st_uid)
            why = f"belongs to {owner}, not to you: jobgen writes only into a directory of yours here"
            raise UntrustedDirectory(path, why)
        if mode & 0o022:
            raise UntrustedDirectory(
                path,
                f"others may write it (mode {mode:o}): files planted there would be taken for yours; "
                "`chmod go-w` it if you trust what is in it, else remove it",
            )
        return
    if mode & 0o002:
        raise UntrustedDirectory(path, f"everyone may write it (mode {mode:o}); a shared directory is a group's")
    if st.st_uid not in (me, 0) and mode & 0o020 == 0 and st.st_gid not in os.getgroups():
        raise UntrustedDirectory(path, f"belongs to {owner_name(st.st_uid)} and is not shared with a group of yours")
    if mode & 0o020 and not (mode & stat.S_ISGID and mode & stat.S_ISVTX):
        raise UntrustedDirectory(
            path,
            f"group members may write it (mode {mode:o}) but it lacks the setgid and sticky bits "
            "(`chmod 3775` it): without them a member can move your files aside and plant links in their place",
        )


def _refuse_open(path: Path, exc: OSError) -> UntrustedDirectory:
    if isinstance(exc, NotADirectoryError) or exc.errno == 40:  # ELOOP: O_NOFOLLOW met a link
        try:
            kind = "a symbolic link" if stat.S_ISLNK(os.lstat(path).st_mode) else "not a directory"
        except OSError:
            kind = "not a directory"
        return UntrustedDirectory(path, f"is {kind}: jobgen follows no link here and writes only into a directory")
    return UntrustedDirectory(path, f"cannot open it: {exc.strerror or exc}")


class OwnedDir:
    """An opened, checked directory (module docstring). Use as a context manager, or close()."""

    def __init__(self, fd: int, path: Path, sharing: Sharing):
        self.fd = fd
        self.path = path
        self.sharing = sharing

    # ---------------------------------------------------------------- opening

    @classmethod
    def open(cls, path: str | os.PathLike[str], sharing: Sharing = Sharing.PRIVATE) -> OwnedDir:
        """The existing directory at ``path``, checked. FileNotFoundError when there is none."""
        path = Path(path)
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _refuse_open(path, exc) from None
        return cls._checked(fd, path, sharing)

    @classmethod
    def ensure(cls, path: str | os.PathLike[str], mode: int = 0o700, sharing: Sharing = Sharing.PRIVATE) -> OwnedDir:
        """The directory at ``path``, made with exactly ``mode`` (whatever the umask) when it is
        not there, then opened and checked like :meth:`open`. Its parents are made as
        ``mkdir -p`` makes them: they are only a way to it, and what matters is checked here."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return cls.open(path, sharing)
        fd = os.open(path, _DIR_FLAGS)
        os.fchmod(fd, mode)  # mkdir's mode passes through the umask; a chmod does not
        return cls._checked(fd, path, sharing)

    @classmethod
    def _checked(cls, fd: int, path: Path, sharing: Sharing) -> OwnedDir:
        try:
            check_trust(os.fstat(fd), path, sharing)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, sharing)

    def subdir(self, name: str, sharing: Sharing | None = None) -> OwnedDir:
        """The existing directory ``name`` in this one, opened relative to it, never through a
        link, checked as ``sharing`` (default: this directory's)."""
        path = self.path / name
        try:
            fd = os.open(_plain(name), _DIR_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _refuse_open(path, exc) from None
        return self._checked(fd, path, sharing or self.sharing)

    def make_subdir(self, name: str, mode: int = 0o700) -> OwnedDir:
        """A new directory ``name`` here with exactly ``mode``; FileExistsError when the name is taken."""
        os.mkdir(_plain(name), 0o700, dir_fd=self.fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        os.fchmod(fd, mode)
        return self._checked(fd, self.path / name, Sharing.PRIVATE)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OwnedDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- inside it

    def pinned(self) -> Path:
        """A path that resolves to this directory itself for as long as it is open, whatever is
        renamed meanwhile (for code that only takes paths). Valid in forked children too."""
        return Path(f"/proc/{os.getpid()}/fd/{self.fd}")

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(_plain(name), dir_fd=self.fd, follow_symlinks=False)

    def names(self) -> list[str]:
        """The names in this directory (an fd's listing: what is here now, not at a path)."""
        with os.scandir(self.fd) as it:
            return [entry.name for entry in it]

    def open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of ``name`` here, never through a link, never blocking on a FIFO."""
        return os.open(_plain(name), flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def rename(self, name: str, new_name: str) -> None:
        """Rename within this directory (a link is renamed as itself, never followed)."""
        os.rename(_plain(name), _plain(new_name), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        os.unlink(_plain(name), dir_fd=self.fd)

    def remove_tree(self, name: str) -> None:
        """Remove ``name`` here and everything under it, following no link at any depth (a
        link is removed as itself). Gone already is fine; what cannot be removed stays."""
        try:
            st = self.lstat(name)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=self.fd)
            return
        assert shutil.rmtree.avoids_symlink_attacks  # fd-based on Linux: no link followed inside
        shutil.rmtree(_plain(name), dir_fd=self.fd, ignore_errors=True)

    def walk_stats(self, name: str, limit: int) -> Iterator[os.stat_result]:
        """lstat of ``name`` and of what is under it, at most ``limit`` entries, following no
        link (``os.fwalk`` relative to this directory): how a staging directory's age is told
        without ever walking into a link someone planted."""
        yield self.lstat(name)
        seen = 1
        for _root, dirs, files, root_fd in os.fwalk(_plain(name), dir_fd=self.fd, follow_symlinks=False):
            for entry in dirs + files:
                if seen >= limit:
                    return
                seen += 1
                try:
                    yield os.stat(entry, dir_fd=root_fd, follow_symlinks=False)
                except FileNotFoundError:
                    pass

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError:  # some filesystems (NFS, Lustre) refuse fsync on directories
            pass


def _plain(name: str) -> str:
    """``name`` as one entry of a directory: no separator, not "." or ".."."""
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"not a plain name: {name!r}")
    return name
