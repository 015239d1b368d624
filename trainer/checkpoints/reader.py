"""Read a torch.distributed.checkpoint (DCP) directory without running anything it holds,
waiting on anything in it, or allocating or decompressing more than its files hold.

DCP reads a checkpoint's ``.metadata`` with ``pickle.load`` and every non-tensor item of its
``.distcp`` shards with ``torch.load(weights_only=False)``: a checkpoint directory that a
teammate can write would run their code as whoever resumes, exports or serves the run. It
opens whatever file the metadata names (a FIFO waits forever, a link to ``/dev/zero`` never
ends), reads as many bytes as the metadata says, and decompresses what the metadata asks.
Every checkpoint jobgen reads goes through :func:`load` and :class:`CheckpointReader` instead:

- ``.metadata`` is unpickled admitting only what DCP's ``Metadata`` is made of
  (:data:`METADATA_GLOBALS`: found by listing the globals in real checkpoints of every kind
  the trainer writes: DDP, FSDP, pipeline, LoRA, optimizer in backward, Adafactor), and
  setting attributes only on the metadata's own objects. Anything else is refused by name:
  ``refusing to load <dir>/.metadata: it asks for os.system``. The files it lists must be
  plain names inside the checkpoint directory, each item's place in its file a range
  (offset and length, integers from 0), and no item may ask for a transform (DCP's zstd
  extension): the trainer's writer (checkpointer.storage_writer) writes none, and nothing a
  checkpoint holds is decompressed.
- Every file of a checkpoint (``.metadata``, a shard, an RNG file: :func:`open_file`,
  :func:`read_file`) is opened as the regular file it must be, never through a symbolic link
  and without waiting (``O_NOFOLLOW | O_NONBLOCK``, jobgen.base.safe_read.open_regular): a
  link, a FIFO or a device is refused by name.
- Each item is read only where it lies inside its shard's size as ``fstat`` gives it,
  checked before a byte of it is read or allocated: a metadata claiming 1 GiB of a small
  file is a checkpoint cut short, not 1 GiB of memory.
- Each item (and an RNG file) must be what ``torch.save`` writes: a zip whose records are
  stored, never compressed (:func:`check_stored_zip`, before ``torch.load`` sees it). torch's
  zip reader inflates a deflated record into a buffer of the size its header claims: a
  record of kilobytes could claim terabytes.
- A non-tensor item (the optimizer's hyperparameters) is read with
  ``torch.load(weights_only=True)``; one that asks for a global outside torch's weights-only
  set is refused naming its shard, its item and the global.
- Tensors DCP itself reads with ``weights_only=True``.

The refusals are :class:`CheckpointRefused`, an :class:`UnreadableCheckpoint` like a
``.metadata`` that is missing or cut short, or an item that lies past its shard's end: a
checkpoint that does not load, whatever loads it (resume sets it aside and falls back to the
previous one, export skips it or names it). Each is one line naming the file.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, filesystem, metadata
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from jobgen.base.safe_read import DamagedFile, open_regular, read_bytes
from jobgen.base.visible import visible

METADATA_FILE = ".metadata"  # DCP's name for it (filesystem._metadata_fn)

# The classes (and callables) a .metadata may name, as (module, name) as a pickle spells them.
_METADATA_CLASSES = (
    metadata.Metadata,
    metadata.TensorStorageMetadata,
    metadata.BytesStorageMetadata,
    metadata.ChunkStorageMetadata,
    metadata.TensorProperties,
    metadata.StorageMeta,
    metadata.MetadataIndex,
    filesystem._StorageInfo,
)
# The enums a .metadata holds. Python 3.11.0 to 3.11.4 (Debian bookworm's python3 is 3.11.2) and
# 3.12.0 pickle an enum member as a call of builtins.getattr with its class and its name; later
# releases as a call of the class with its value. Both are read; getattr only as this lookup.
_METADATA_ENUMS = (metadata._MEM_FORMAT_ENCODING,)


class _GetattrRefused(pickle.UnpicklingError):
    """A getattr the pickle asks for that is no enum member's lookup (the message says which)."""


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` as an enum's pickle asks it: only a member of a metadata enum."""
    if cls not in _METADATA_ENUMS or not isinstance(name, str) or name not in cls.__members__:
        raise _GetattrRefused(f"getattr({getattr(cls, '__qualname__', type(cls).__qualname__)}, {name!r})")
    return cls[name]


METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _METADATA_CLASSES},
    ("builtins", "getattr"): _enum_member,
    (metadata.__name__, "_MEM_FORMAT_ENCODING"): metadata._MEM_FORMAT_ENCODING,
    ("torch", "Size"): torch.Size,
    # torch.layout pickles as a call of this with the layout's name: a lookup in torch's layouts.
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    # StorageMeta.checkpoint_id: the directory it was saved to (pathlib._local from Python 3.13).
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,
    # Every dtype (torch.float32 ...) pickles as a global of torch.
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}
# The objects a pickle's BUILD may set attributes on: the metadata's own instances. BUILD on
# anything else (a class, a function) would change it for the whole process.
_BUILDABLE = frozenset(_METADATA_CLASSES)


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint file that cannot be read as DCP wrote it; the message names the file."""


class CheckpointRefused(UnreadableCheckpoint):
    """A checkpoint file that asks for code to run, for a file outside its checkpoint, for a
    transform or a decompression, or that is no regular file (a link, a FIFO, a device)."""


class _Abort(BaseException):
    """Carries an UnreadableCheckpoint out of DCP's call of ``read_metadata``. DCP catches every
    Exception raised there, logs it with its traceback and goes looking for other metadata
    files; a BaseException (like DCP's own CheckpointException) ends the load at once, and
    DCP hands it to every rank inside a CheckpointException, where :func:`load` finds it."""

    def __init__(self, error: UnreadableCheckpoint):
        super().__init__(error)
        self.error = error


class _MetadataUnpickler(pickle._Unpickler):
    """pickle's Python implementation, whose opcodes can be overridden (the C one's cannot):
    globals only from METADATA_GLOBALS, BUILD only on the metadata's own objects."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BufferedIOBase, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = METADATA_GLOBALS.get((module, name))
        if found is None:
            raise CheckpointRefused(f"refusing to load {self.path}: it asks for {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointRefused(f"refusing to load {self.path}: it asks for a persistent object")

    def _build(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if type(target) not in _BUILDABLE:
            what = getattr(target, "__qualname__", type(target).__qualname__)
            raise CheckpointRefused(f"refusing to load {self.path}: it sets attributes of {what}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


def _cannot_open(path: Path, exc: OSError | DamagedFile) -> UnreadableCheckpoint:
    """The one line for a checkpoint file that could not be opened as a regular file."""
    if isinstance(exc, DamagedFile):
        if exc.problem.startswith("is "):  # a link, a FIFO, a device, a directory, too large
            return CheckpointRefused(f"refusing to load {visible(path)}: it {visible(exc.problem)}")
        return UnreadableCheckpoint(
            f"cannot read {visible(path)}: {visible(exc.problem.removeprefix('cannot read it: '))}"
        )
    return UnreadableCheckpoint(f"cannot read {visible(path)}: {exc.strerror or exc}")


def open_file(path: Path) -> BinaryIO:
    """The checkpoint file at ``path``, open for reading: a regular file, never followed
    through a link, never waited on (a FIFO). :class:`CheckpointRefused` for anything else,
    :class:`UnreadableCheckpoint` when it is missing or cannot be read."""
    try:
        fd = open_regular(path)
    except (OSError, DamagedFile) as exc:
        raise _cannot_open(path, exc) from None
    return os.fdopen(fd, "rb")


def read_file(path: Path, limit: int) -> bytes:
    """The content of the small checkpoint file at ``path`` (an RNG file), read as
    :func:`open_file` opens it and refused beyond ``limit`` bytes. FileNotFoundError when
    there is none (the caller knows what that means)."""
    try:
        return read_bytes(path, limit)
    except FileNotFoundError:
        raise
    except (OSError, DamagedFile) as exc:
        raise _cannot_open(path, exc) from None


# The zip records torch.save writes (PKWARE's APPNOTE), as torch's zip reader (miniz) finds them.
_LOCAL_SIG = b"PK\x03\x04"
_END_SIG = b"PK\x05\x06"
_END_SIZE = 22
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_ZIP64_LOCATOR_SIZE = 20
_ZIP64_END_SIG = b"PK\x06\x06"
_ZIP64_END_SIZE = 56
_ENTRY_SIG = b"PK\x01\x02"
_ENTRY_SIZE = 46
# How far from its end miniz looks for the end record (a comment of at most 65535 bytes), and more.
_END_SEARCH = 0xFFFF + _END_SIZE + 8192


def check_stored_zip(read_at: Callable[[int, int], bytes], size: int, where: str) -> None:
    """Refuse (:class:`CheckpointRefused`) what ``torch.load`` would decompress: ``size`` bytes,
    read by ``read_at(offset, count)``, must be a zip whose central directory (found as torch's
    zip reader, miniz, finds it: the last end record in the file's last 64 KiB) lists only
    stored records. torch.save stores every record; torch's reader would inflate a deflated
    one into a buffer of the size it claims. :class:`UnreadableCheckpoint` for a zip that
    torch's reader would refuse anyway (cut short, a directory outside the file). Reads only
    the end records and the directory, one entry at a time."""

    def exact(offset: int, count: int) -> bytes:
        data = read_at(offset, count) if offset >= 0 and offset + count <= size else b""
        if len(data) != count:
            raise UnreadableCheckpoint(f"cannot read {where}: its zip directory lies outside it (cut short?)")
        return data

    if size < _END_SIZE or read_at(0, 4) != _LOCAL_SIG:
        raise CheckpointRefused(f"refusing to load {where}: it is not the zip torch.save writes")
    end = size - _END_SIZE
    if exact(end, 4) != _END_SIG:  # torch.save writes no comment: the end record ends the file
        start = max(0, size - _END_SEARCH)
        tail = exact(start, size - start)
        found = tail.rfind(_END_SIG, 0, len(tail) - _END_SIZE + 4)
        if found < 0:
            raise UnreadableCheckpoint(f"cannot read {where}: it has no zip directory (cut short?)")
        end = start + found
    record = exact(end, _END_SIZE)
    entries, directory_size, directory = struct.unpack_from("<HII", record, 10)
    if end >= _ZIP64_LOCATOR_SIZE + _ZIP64_END_SIZE:
        locator = exact(end - _ZIP64_LOCATOR_SIZE, _ZIP64_LOCATOR_SIZE)
        if locator[:4] == _ZIP64_LOCATOR_SIG:
            (offset,) = struct.unpack_from("<Q", locator, 8)
            zip64 = exact(offset, _ZIP64_END_SIZE)
            if zip64[:4] == _ZIP64_END_SIG:
                entries, directory_size, directory = struct.unpack_from("<QQQ", zip64, 32)
    if directory_size < entries * _ENTRY_SIZE or directory + directory_size > size:
        raise UnreadableCheckpoint(f"cannot read {where}: its zip directory lies outside it (cut short?)")
    at = directory
    for _ in range(entries):
        entry = exact(at, _ENTRY_SIZE)
        if entry[:4] != _ENTRY_SIG:
            raise UnreadableCheckpoint(f"cannot read {where}: its zip directory is damaged")
        (method,) = struct.unpack_from("<H", entry, 10)
        name_size, extra_size, comment_size = struct.unpack_from("<HHH", entry, 28)
        if method != 0:
            name = visible(exact(at + _ENTRY_SIZE, name_size).decode("utf-8", "replace"))
            raise CheckpointRefused(
                f"refusing to load {where}: its record {name} is compressed (method {method}); "
                "torch.save compresses nothing, and nothing a checkpoint holds is decompressed"
            )
        at += _ENTRY_SIZE + name_size + extra_size + comment_size


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def read_metadata_file(path: Path) -> metadata.Metadata:
    """The ``Metadata`` in ``path`` (a checkpoint's ``.metadata``), unpickled admitting only what
    DCP writes. Raises :class:`CheckpointRefused` for anything else, :class:`UnreadableCheckpoint`
    for a file that cannot be read or is not DCP's metadata."""
    try:
        with open_file(path) as fh:
            found = _MetadataUnpickler(fh, path).load()
    except UnreadableCheckpoint:
        raise
    except _GetattrRefused as exc:
        raise CheckpointRefused(f"refusing to load {path}: it asks for {exc}") from None
    except OSError as exc:
        raise UnreadableCheckpoint(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - cut short, garbage, a bad state for an allowed class
        raise UnreadableCheckpoint(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    if not (
        isinstance(found, metadata.Metadata)
        and isinstance(found.state_dict_metadata, dict)
        and isinstance(found.storage_data, dict)
    ):
        raise UnreadableCheckpoint(f"cannot read {path}: it is not the metadata of a DCP checkpoint")
    for info in found.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, filesystem._StorageInfo) or not _plain_name(name):
            raise CheckpointRefused(f"refusing to load {path}: it names {name!r}, not a file of its checkpoint")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_count(offset) and _count(length)):
            raise CheckpointRefused(
                f"refusing to load {path}: it places an item of {name!r} at offset {visible(repr(offset))[:40]}, "
                f"length {visible(repr(length))[:40]}: no range of a file"
            )
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not (isinstance(transforms, list | tuple) and not transforms):
            raise CheckpointRefused(
                f"refusing to load {path}: it asks for the transform {visible(repr(transforms))[:80]} on {name!r}; "
                "the trainer writes none, and nothing a checkpoint holds is decompressed"
            )
    return found


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _RegularFiles(filesystem.FileSystem):
    """DCP's file system, opening every file it reads with :func:`open_file`."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise ValueError(f"a checkpoint is only read here, not opened with mode {mode!r}")
        with open_file(Path(path)) as stream:
            yield stream  # type: ignore[misc]


class CheckpointReader(FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_metadata_file`, once: every
    ``dcp.load`` asks its reader for the metadata again, and the answer does not change.
    Its shards are opened by :func:`open_file`, and each item is read (:meth:`_slice_file`)
    only inside its shard's size and only as a stored zip (:func:`check_stored_zip`)."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self.fs = _RegularFiles()
        self._metadata: metadata.Metadata | None = None

    @property
    def metadata_file(self) -> Path:
        return Path(self.path) / METADATA_FILE

    def metadata(self) -> metadata.Metadata:
        """The checkpoint's metadata; raises :class:`UnreadableCheckpoint` (or CheckpointRefused)."""
        if self._metadata is None:
            self._metadata = read_metadata_file(self.metadata_file)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata sets it
        return self._metadata

    def read_metadata(self) -> metadata.Metadata:  # type: ignore[override]
        # Without **kwargs: DCP then never falls back to reading per-rank metadata files.
        try:
            return self.metadata()
        except UnreadableCheckpoint as exc:
            raise _Abort(exc) from None

    def reset(self, checkpoint_id: str | Path | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._metadata = None

    def _slice_file(self, file: Any, sinfo: filesystem._StorageInfo) -> IO[bytes]:
        """The item at ``sinfo`` of the shard open as ``file``, checked before DCP reads it:
        inside the shard as it is now (``fstat``), no transform, a stored zip."""
        shard = visible(Path(self.path) / sinfo.relative_path)
        if sinfo.transform_descriptors:  # read_metadata_file refused it already; every read comes here
            raise CheckpointRefused(f"refusing to load {shard}: an item asks for a transform")
        fd = file.fileno()
        size = os.fstat(fd).st_size
        offset, length = sinfo.offset, sinfo.length
        if not (_count(offset) and _count(length)) or offset + length > size:
            raise UnreadableCheckpoint(
                f"cannot read {shard}: the metadata places an item at bytes {offset} to {offset + length} "
                f"of a file of {size} bytes (cut short?)"
            )
        check_stored_zip(lambda at, count: os.pread(fd, count, offset + at), length, str(shard))
        return super()._slice_file(file, sinfo)

    def item_location(self, item: ReadItem) -> str:
        """Where a read item lives, for messages: its shard file and its key."""
        info = self.storage_data.get(item.storage_index)
        shard = Path(self.path) / info.relative_path if info is not None else Path(self.path)
        return f"{shard} (item {item.storage_index.fqn})"


def read_value(data: bytes, where: str) -> Any:
    """A non-tensor item of a checkpoint, or an RNG file (``torch.save`` bytes), read with
    ``weights_only=True``: a stored zip (:func:`check_stored_zip`), and a global torch does not
    admit there is refused by name."""
    check_stored_zip(lambda at, count: data[at : at + count], len(data), where)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - a zip torch cannot read: torch.load below refuses it
        unsafe = []
    if unsafe:
        raise CheckpointRefused(f"refusing to load {where}: it asks for {sorted(unsafe)[0]}")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointRefused(f"refusing to load {where}: it is not a plain value (weights_only)") from None


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with :func:`read_value`."""

    def __init__(self, reader: CheckpointReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        found = read_value(value.getvalue(), self.reader.item_location(read_item))
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], found)
        else:
            self.state_dict[read_item.dest_index.fqn] = found


def unreadable_cause(exc: BaseException) -> UnreadableCheckpoint | None:
    """The UnreadableCheckpoint behind a failed DCP load (on the lowest rank that had one), if any."""
    if isinstance(exc, UnreadableCheckpoint):
        return exc
    if isinstance(exc, _Abort):
        return exc.error
    if isinstance(exc, CheckpointException):
        for _, failure in sorted(exc.failures.items()):
            error = failure[0] if isinstance(failure, tuple) else failure
            found = unreadable_cause(error) if isinstance(error, BaseException) else None
            if found is not None:
                return found
    return None


def load(
    state: dict[str, Any], path: str | Path, *, reader: CheckpointReader | None = None, no_dist: bool = False
) -> None:
    """``dcp.load(state)`` from the checkpoint at ``path`` (read by ``reader`` if given, which
    keeps its metadata between loads) that runs nothing the checkpoint holds. Collective
    unless ``no_dist``, like dcp.load. Raises :class:`UnreadableCheckpoint` (the same on every
    rank) for a refused or unreadable metadata or item, DCP's exceptions for anything else."""
    reader = reader if reader is not None else CheckpointReader(path)
    try:
        dcp.load(state, storage_reader=reader, planner=CheckpointLoadPlanner(reader), no_dist=no_dist)
    except CheckpointException as exc:
        cause = unreadable_cause(exc)
        if cause is None:
            raise
        raise cause from None
