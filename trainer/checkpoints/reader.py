"""Read a torch.distributed.checkpoint (DCP) directory without running anything it holds.

DCP reads a checkpoint's ``.metadata`` with ``pickle.load`` and every non-tensor item of its
``.distcp`` shards with ``torch.load(weights_only=False)``: a checkpoint directory that a
teammate can write would run their code as whoever resumes, exports or serves the run.
Every checkpoint jobgen reads goes through :func:`load` and :class:`CheckpointReader` instead:

- ``.metadata`` is unpickled admitting only what DCP's ``Metadata`` is made of
  (:data:`METADATA_GLOBALS`: found by listing the globals in real checkpoints of every kind
  the trainer writes: DDP, FSDP, pipeline, LoRA, optimizer in backward, Adafactor), and
  setting attributes only on the metadata's own objects. Anything else is refused by name:
  ``refusing to load <dir>/.metadata: it asks for os.system``. The files it lists must be
  plain names inside the checkpoint directory.
- A non-tensor item (the optimizer's hyperparameters) is read with
  ``torch.load(weights_only=True)``; one that asks for a global outside torch's weights-only
  set is refused naming its shard, its item and the global.
- Tensors DCP itself reads with ``weights_only=True``.

Both refusals are :class:`CheckpointRefused`, an :class:`UnreadableCheckpoint` like a
``.metadata`` that is missing or cut short: a checkpoint that does not load, whatever loads
it (resume falls back to the previous one, export skips it or names it).
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, filesystem, metadata
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

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
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _METADATA_CLASSES},
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
    """A checkpoint file that asks for code to run, or for a file outside its checkpoint."""


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


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def read_metadata_file(path: Path) -> metadata.Metadata:
    """The ``Metadata`` in ``path`` (a checkpoint's ``.metadata``), unpickled admitting only what
    DCP writes. Raises :class:`CheckpointRefused` for anything else, :class:`UnreadableCheckpoint`
    for a file that cannot be read or is not DCP's metadata."""
    try:
        with open(path, "rb") as fh:
            found = _MetadataUnpickler(fh, path).load()
    except UnreadableCheckpoint:
        raise
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
    return found


class CheckpointReader(FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_metadata_file`, once: every
    ``dcp.load`` asks its reader for the metadata again, and the answer does not change."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
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

    def item_location(self, item: ReadItem) -> str:
        """Where a read item lives, for messages: its shard file and its key."""
        info = self.storage_data.get(item.storage_index)
        shard = Path(self.path) / info.relative_path if info is not None else Path(self.path)
        return f"{shard} (item {item.storage_index.fqn})"


def read_value(data: bytes, where: str) -> Any:
    """A non-tensor item of a checkpoint (``torch.save`` bytes), read with ``weights_only=True``;
    a global torch does not admit there is refused by name."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - not torch.save's zip format: torch.load below refuses it or reads it safely
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
