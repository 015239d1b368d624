"""The tokenized examples as every rank reads them: a cache entry's Arrow files, memory-mapped
with pyarrow (:class:`Examples`).

Rank 0 writes an entry with ``datasets`` (:mod:`trainer.data.build`, ``save_to_disk``: a
``state.json`` naming Arrow stream files); every rank of every launch then only reads it. The
read needs nothing of ``datasets`` but its file layout, and importing ``datasets`` cost each
rank about a CPU-second at every start (a relaunch, each task of an array, each rank), so
ranks read the files with pyarrow alone and a start on a warm cache never imports ``datasets``.

A shared cache a teammate can write is data, never code, and an entry may have been planted or
damaged by someone else: this reads JSON and Arrow IPC streams, nothing else, and checks an
entry in full before anything uses it, so that what it hands on can be read row by row without
a signal, a hang or a traceback:

- ``state.json`` is read as :mod:`jobgen.base.safe_read` reads a run's files (a small regular
  file, no link followed, never waiting on a FIFO) and must name data files inside its directory;
- each data file is opened the same way (``O_NOFOLLOW``, ``O_NONBLOCK``, a regular file of at
  most :data:`DATA_FILE_LIMIT` bytes) and memory-mapped from that descriptor, never reopened by
  name; its messages are a schema and uncompressed record batches, each buffer a slice of the
  mapped file (nothing copied, nothing decompressed);
- the schema is exactly the trainer's: ``input_ids`` and ``labels`` lists of int32 or int64,
  ``length`` an integer, no other column, no nulls;
- every list's offsets are checked with numpy (in order, inside the values), ``input_ids`` and
  ``labels`` hold as many tokens per row and ``length`` is that number; every token id is at
  least 0 (a label may be -100, the ignored one) and, given the vocabulary's size, below it. One
  vectorised pass over the values and one over the offsets: no Python object per row or token.

Everything wrong is a :class:`DataCacheError` of one line naming the file and what is wrong.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from jobgen.base.safe_read import DamagedFile, open_regular, read_json
from jobgen.base.visible import visible

# The columns trainer.data.build writes and the trainer reads.
COLUMNS = ("input_ids", "labels", "length")
LIST_COLUMNS = ("input_ids", "labels")
# The label of a token the loss ignores, the one negative value a label may have.
IGNORED_LABEL = -100
# The most bytes of state.json: datasets writes a few hundred, a line per data file.
STATE_LIMIT = 1 << 20
# The most bytes of one data file: save_to_disk writes shards of at most 500 MB.
DATA_FILE_LIMIT = 8 << 30
# The values scanned at a time when checking token ids (a few MiB: the scan stays in cache).
_SCAN = 1 << 20
_INTEGERS = (pa.int32(), pa.int64())


def _row_numbers(rows: np.ndarray) -> pa.Array:
    """``rows`` as an Arrow int64 array over the same memory. Not ``pa.array``: it imports pandas
    (half a CPU-second, on every rank) to ask whether its argument is a pandas object."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])


class DataCacheError(RuntimeError):
    """The data cache could not be built, found or read; the message says which rank or file."""


class _Refused(Exception):
    """What is wrong with the data file being read; :func:`_read_data_file` names the file."""


# --------------------------------------------------------------------------- state.json


def _data_file_names(state_file: Path) -> list[str]:
    """The data files ``state.json`` names, each a plain name inside its directory."""
    try:
        state = read_json(state_file, STATE_LIMIT)
    except FileNotFoundError:
        raise DataCacheError(f"{visible(state_file)}: missing: not a dataset record") from None
    except DamagedFile as exc:
        raise DataCacheError(f"{exc} (not a readable dataset record)") from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f for f in files):
        raise DataCacheError(
            f"{visible(state_file)}: not a readable dataset record (no '_data_files' list of objects with a filename)"
        )
    names = [f["filename"] for f in files]
    for name in names:
        shown = visible(repr(name))[:200]  # repr: a lone surrogate could be neither printed nor logged
        if not isinstance(name, str):
            raise DataCacheError(f"{visible(state_file)}: names a data file by no file name: {shown}")
        if name in ("", ".", "..") or "/" in name:
            raise DataCacheError(f"{visible(state_file)}: names a data file outside its directory: {shown}")
        if not name.isprintable():  # control characters, NUL, surrogates: no name datasets writes
            raise DataCacheError(f"{visible(state_file)}: names a data file that no file name can be: {shown}")
    if not names:
        raise DataCacheError(f"{visible(state_file)}: names no data files")
    if len(set(names)) != len(names):
        raise DataCacheError(f"{visible(state_file)}: names a data file twice")
    return names


# --------------------------------------------------------------------------- one data file


class _Mapped:
    """A data file mapped read-only, and the way to let go of the pages a check has read."""

    def __init__(self, region: mmap.mmap):
        self.region, self.buffer = region, pa.py_buffer(region)

    def release(self) -> None:
        """Drop the pages read so far from this process (they stay in the page cache and come
        back on the next read): checking a file reads all of it, and without this the
        process's resident memory would grow with the data it merely validated."""
        self.region.madvise(mmap.MADV_DONTNEED)


# Bytes of a data file checked between two releases of its pages.
_RELEASE_EVERY = 64 << 20


def _map(path: Path) -> _Mapped:
    """The data file at ``path``, memory-mapped from a descriptor that followed no link."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > DATA_FILE_LIMIT:
            raise _Refused(f"is larger than {DATA_FILE_LIMIT >> 30} GiB, more than any data file datasets writes")
        if size == 0:
            raise _Refused("is empty")
        return _Mapped(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)


def _compressed(metadata: pa.Buffer) -> bool:
    """Whether a record batch message's body is compressed: the ``compression`` field (4th) of
    its RecordBatch header in the Message flatbuffer (Arrow's format/Message.fbs). Read before
    the body is: a compressed buffer declares its own decompressed size, and pyarrow allocates it."""
    data = memoryview(metadata)

    def at(position: int, kind: str) -> int:
        if not 0 <= position <= len(data) - struct.calcsize(kind):
            raise _Refused("has a record batch message whose metadata points outside itself")
        return struct.unpack_from(kind, data, position)[0]

    def field(table: int, slot: int) -> int:  # the position of a field of a table; 0 when absent
        vtable = table - at(table, "<i")
        present = 4 + 2 * slot < at(vtable, "<H")
        offset = at(vtable + 4 + 2 * slot, "<H") if present else 0
        return table + offset if offset else 0

    message = at(0, "<I")
    header = field(message, 2)  # Message: version, header_type, header, bodyLength, custom_metadata
    if not header:
        raise _Refused("has a record batch message without its header")
    return field(header + at(header, "<I"), 3) != 0  # RecordBatch: length, nodes, buffers, compression


def _checked_schema(schema: pa.Schema) -> pa.Schema:
    """The trainer's three columns and their types, nothing else."""
    missing = [c for c in COLUMNS if c not in schema.names]
    if missing:
        raise _Refused(f"has no column(s) {', '.join(missing)}")
    extra = [n for n in schema.names if n not in COLUMNS]
    if extra:
        raise _Refused(f"has column(s) {visible(', '.join(extra))[:200]} besides {', '.join(COLUMNS)}")
    twice = [n for n in COLUMNS if schema.names.count(n) > 1]
    if twice:
        raise _Refused(f"has column(s) {', '.join(twice)} more than once")
    for name in COLUMNS:
        kind = schema.field(name).type
        fits = kind in _INTEGERS if name == "length" else pa.types.is_list(kind) and kind.value_type in _INTEGERS
        if not fits:
            wanted = "an int32 or int64" if name == "length" else "a list of int32 or int64"
            raise _Refused(f"column {name} is {visible(kind)[:200]}, not {wanted}")
    return schema


def _no_copies(batch: pa.RecordBatch, whole: pa.Buffer) -> None:
    """Every buffer of ``batch`` a slice of the mapped file: nothing decoded into memory (a
    byte-swapped or realigned buffer is a copy, and the entry must cost no memory to open)."""
    end = whole.address + whole.size
    for column in batch.columns:
        for buffer in column.buffers():
            if buffer is not None and buffer.size and not whole.address <= buffer.address <= end - buffer.size:
                raise _Refused("has buffers pyarrow had to copy to read (byte-swapped or misaligned)")


def _numbers(array: pa.Array) -> np.ndarray:
    """An int32 or int64 array's values as numpy, over the same memory. Not ``to_numpy``: it
    imports pandas (half a CPU-second, on every rank)."""
    buffer = array.buffers()[1]
    kind = np.int32 if array.type == pa.int32() else np.int64
    count = 0 if buffer is None else buffer.size // np.dtype(kind).itemsize
    values = np.frombuffer(buffer or b"", dtype=kind, count=count)[array.offset : array.offset + len(array)]
    if len(values) != len(array):
        raise _Refused(f"a buffer of type {array.type} is shorter than its length")
    return values


def _offsets(name: str, array: pa.ListArray) -> np.ndarray:
    """The offsets of ``array`` (one list column of one batch), checked: in order, inside its values."""
    if array.null_count or array.buffers()[0] is not None:
        raise _Refused(f"column {name} has null rows")
    buffer = array.buffers()[1]
    if buffer is None:
        raise _Refused(f"column {name} has no offsets")
    first = array.offset
    offsets = np.frombuffer(buffer, dtype=np.int32, count=buffer.size // 4)[first : first + len(array) + 1]
    if len(offsets) != len(array) + 1:
        raise _Refused(f"column {name}: its offsets buffer is shorter than its rows")
    if offsets[0] < 0 or offsets[-1] > len(array.values) or np.any(offsets[1:] < offsets[:-1]):
        raise _Refused(f"column {name}: its list offsets are out of order or point outside its values")
    return offsets


def _check_ids(name: str, array: pa.ListArray, offsets: np.ndarray, vocab_size: int | None) -> None:
    """Every token id of ``array`` in [0, vocab_size) (a label may also be -100)."""
    values = array.values
    if values.null_count or values.buffers()[0] is not None:
        raise _Refused(f"column {name} has null token ids")
    values = _numbers(values)[offsets[0] : offsets[-1]]
    labels = name == "labels"
    for start in range(0, len(values), _SCAN):
        part = values[start : start + _SCAN]
        low, high = int(part.min()), int(part.max())
        if vocab_size is not None and high >= vocab_size:
            raise _Refused(f"column {name}: token id {high} is beyond the vocabulary ({vocab_size} ids)")
        if low >= 0:
            continue
        ignored = labels and low == IGNORED_LABEL  # then each negative label must be -100
        if ignored and np.count_nonzero(part < 0) == np.count_nonzero(part == IGNORED_LABEL):
            continue
        wrong = int(part[(part < 0) & (part != IGNORED_LABEL)][0]) if ignored else low
        raise _Refused(f"column {name}: token id {wrong} is negative" + (" (and not -100)" if labels else ""))


def _check_batch(batch: pa.RecordBatch, vocab_size: int | None) -> None:
    """Offsets, lengths and token ids of one record batch, with numpy over its buffers."""
    batch.validate()  # buffer sizes against the lengths: no pass over the data
    if batch.num_rows == 0:
        return
    offsets = {name: _offsets(name, batch.column(name)) for name in LIST_COLUMNS}
    tokens = np.diff(offsets["input_ids"])
    if not np.array_equal(tokens, np.diff(offsets["labels"])):
        raise _Refused("a row's input_ids and labels hold different numbers of tokens")
    length = batch.column("length")
    if length.null_count or length.buffers()[0] is not None:
        raise _Refused("column length has nulls")
    if not np.array_equal(_numbers(length), tokens):
        raise _Refused("column length is not the number of tokens of its row")
    for name in LIST_COLUMNS:
        _check_ids(name, batch.column(name), offsets[name], vocab_size)


def _messages(mapped: _Mapped, checked_schema: Callable[[pa.Schema], pa.Schema]) -> Iterator[pa.RecordBatch]:
    """The record batches of the mapped stream, read over the mapping (nothing decompressed:
    a compressed batch is refused before it is read), its schema passed to ``checked_schema``
    first; the pages read are let go every _RELEASE_EVERY bytes."""
    whole = mapped.buffer
    schema, unreleased = None, 0
    for message in pa.ipc.MessageReader.open_stream(whole):
        if schema is None:
            if message.type != "schema":
                raise _Refused(f"starts with a message of type {visible(message.type)}, not its schema")
            schema = checked_schema(pa.ipc.read_schema(message))
            continue
        if message.type != "record batch":
            raise _Refused(f"holds a message of type {visible(message.type)}; datasets writes record batches only")
        if _compressed(message.metadata):
            raise _Refused("has a compressed record batch; datasets writes none")
        batch = pa.ipc.read_record_batch(message, schema)
        yield batch
        unreleased += batch.nbytes
        if unreleased > _RELEASE_EVERY:
            mapped.release()
            unreleased = 0
    mapped.release()
    if schema is None:
        raise _Refused("holds no schema")


def _batches(mapped: _Mapped, vocab_size: int | None) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """The trainer's columns (their schema) and the record batches of the mapped stream,
    each checked."""
    batches = []
    for batch in _messages(mapped, _checked_schema):
        _no_copies(batch, mapped.buffer)
        _check_batch(batch, vocab_size)
        batches.append(batch.select(list(COLUMNS)))
    schema = batches[0].schema if batches else None
    if schema is None:  # a stream of a schema alone: its types, as the batches would have them
        schema = _checked_schema(pa.ipc.open_stream(mapped.buffer).schema)
    return pa.schema([schema.field(name) for name in COLUMNS]), batches


def _read_data_file(path: Path, vocab_size: int | None) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """The schema and checked record batches of the data file at ``path``; DataCacheError naming it."""
    try:
        return _batches(_map(path), vocab_size)
    except FileNotFoundError:
        raise DataCacheError(f"{visible(path)}: not a readable Arrow stream (missing)") from None
    except DamagedFile as exc:
        raise DataCacheError(f"{exc} (not a readable Arrow stream)") from None
    except _Refused as exc:
        raise DataCacheError(f"{visible(path)}: {exc}") from None
    except (OSError, ValueError, pa.ArrowException) as exc:  # a damaged stream; ArrowMemoryError included
        raise DataCacheError(f"{visible(path)}: not a readable Arrow stream ({visible(exc)[:300]})") from None


# --------------------------------------------------------------------------- the examples


class Examples:
    """Tokenized examples (``input_ids``, ``labels``, ``length``), in order, or a selection of them."""

    def __init__(self, table: pa.Table, indices: np.ndarray | None = None):
        """``table``: the examples; ``indices``: the rows of it this selection holds, in order
        (default all)."""
        self._table = table
        self._indices = indices

    @classmethod
    def open(cls, directory: Path, *, vocab_size: int | None = None) -> Examples:
        """The examples ``datasets``' ``save_to_disk`` wrote into ``directory``, memory-mapped and
        checked in full (the module's docstring); ``vocab_size``: the token ids must be below it."""
        directory = Path(directory)
        schemas, batches = [], []
        for name in _data_file_names(directory / "state.json"):
            schema, more = _read_data_file(directory / name, vocab_size)
            schemas.append(schema)
            batches += more
        if any(not schema.equals(schemas[0]) for schema in schemas):
            raise DataCacheError(f"{visible(directory)}: its data files disagree on their columns' types")
        try:
            table = pa.Table.from_batches(batches, schema=schemas[0])
        except pa.ArrowException as exc:
            raise DataCacheError(f"{visible(directory)}: its data files disagree on their columns ({exc})") from None
        return cls(table)

    def __len__(self) -> int:
        return self._table.num_rows if self._indices is None else len(self._indices)

    @property
    def column_names(self) -> list[str]:
        return list(self._table.column_names)

    def column(self, name: str) -> list[Any]:
        """One column's values, in this selection's order."""
        column = self._table.column(name)
        if self._indices is not None:
            column = column.take(_row_numbers(self._indices))
        return column.to_pylist()

    def lengths(self) -> np.ndarray:
        """The ``length`` column, in this selection's order, as one int64 array: 8 bytes an
        example, no Python object per row (what packing and the sampler need of every example)."""
        chunks = [_numbers(chunk).astype(np.int64) for chunk in self._table.column("length").chunks]
        values = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        return values if self._indices is None else values[self._indices]

    def select(self, indices: Sequence[int] | np.ndarray) -> Examples:
        """The examples at ``indices`` of this selection, in that order."""
        rows = np.asarray(indices, dtype=np.int64)
        return Examples(self._table, rows if self._indices is None else self._indices[rows])

    def take(self, indices: Sequence[int], columns: Sequence[str]) -> dict[str, list[Any]]:
        """``columns`` of the examples at ``indices``, one list per column, in one batched read."""
        rows = np.asarray(indices, dtype=np.int64)
        if self._indices is not None:
            rows = self._indices[rows]
        return self._table.select(list(columns)).take(_row_numbers(rows)).to_pydict()


# --------------------------------------------------------------------------- pre-tokenized, in place


class NotInPlace(Exception):
    """Why pre-tokenized Arrow cannot be trained on as it is (it is prepared into the cache instead)."""


def arrow_files(path: Path) -> list[Path] | None:
    """The Arrow stream files of a ``save_to_disk`` directory (those its ``state.json`` names),
    of a directory whose data files are all ``.arrow``, or one ``.arrow`` file; None for any
    other source (JSON Lines, Parquet... must be decoded: they are prepared, a copy)."""
    from jobgen.spec.data_files import data_files

    path = Path(path)
    if path.is_dir() and (path / "state.json").is_file():
        return [path / name for name in _data_file_names(path / "state.json")]
    if path.is_dir():
        files = data_files(path)
        return files if files and all(f.suffix == ".arrow" for f in files) else None
    return [path] if path.suffix == ".arrow" and path.is_file() else None


def _targets_per_row(labels: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each row's target tokens (labels not -100, the first token never one, as in collate),
    counted in windows of about _SCAN tokens: no array of the whole column's size."""
    counts = np.empty(len(offsets) - 1, dtype=np.int64)
    row = 0
    while row < len(counts):
        end = max(int(np.searchsorted(offsets, offsets[row] + _SCAN, side="right")) - 1, row + 1)
        low = offsets[row]
        mask = labels[low : offsets[end]] != IGNORED_LABEL
        starts = offsets[row:end] - low
        mask[starts] = False
        counts[row:end] = np.add.reduceat(mask, starts, dtype=np.int64)
        row = end
    return counts


def _in_place_batch(
    batch: pa.RecordBatch, whole: pa.Buffer, vocab_size: int, max_length: int
) -> tuple[pa.RecordBatch, int]:
    """The trainer's columns of one batch of the user's pre-tokenized rows, over the mapped
    file: ``labels`` (else ``input_ids``: every token a target) and a ``length`` column made
    here (4 bytes a row), and its target tokens. NotInPlace for rows that need preparing (cut
    or dropped)."""
    names = [n for n in ("input_ids", "labels") if n in batch.schema.names]
    batch = batch.select(names)
    _no_copies(batch, whole)
    batch.validate()
    offsets = {name: _offsets(name, batch.column(name)) for name in names}
    lengths = np.diff(offsets["input_ids"])
    if "labels" in offsets and not np.array_equal(lengths, np.diff(offsets["labels"])):
        raise _Refused("a row's input_ids and labels hold different numbers of tokens")
    for name in names:
        _check_ids(name, batch.column(name), offsets[name], vocab_size)
    if len(lengths) and int(lengths.max()) > max_length:
        raise NotInPlace(f"a row has {int(lengths.max())} tokens, more than max_length = {max_length}: rows are cut")
    if len(lengths) and int(lengths.min()) < 2:
        raise NotInPlace("a row of fewer than 2 tokens has nothing to learn: such rows are dropped")
    labels = batch.column("labels") if "labels" in names else batch.column("input_ids")
    targets = int(lengths.sum()) - len(lengths)  # every token but the first
    if "labels" in names and len(lengths):
        per_row = _targets_per_row(_numbers(labels.values), offsets["labels"])
        if int(per_row.min()) == 0:
            raise NotInPlace("a row has no target token (every label -100): such rows are dropped")
        targets = int(per_row.sum())
    length = pa.Array.from_buffers(pa.int32(), len(lengths), [None, pa.py_buffer(lengths.astype(np.int32))])
    return pa.RecordBatch.from_arrays([batch.column("input_ids"), labels, length], names=list(COLUMNS)), targets


def _token_schema(schema: pa.Schema) -> pa.Schema:
    """A pre-tokenized stream's schema: ``input_ids`` and (if there) ``labels``, each one column
    of lists of int32 or int64; other columns are left unread."""
    for name in ("input_ids", "labels"):
        if name == "labels" and name not in schema.names:
            continue
        kind = schema.field(name).type if schema.names.count(name) == 1 else None
        if kind is None or not (pa.types.is_list(kind) and kind.value_type in _INTEGERS):
            raise _Refused(f"has no one column {name} of lists of int32 or int64 ({visible(schema.names)[:200]})")
    return schema


def _in_place_file(path: Path, vocab_size: int, max_length: int) -> list[tuple[pa.RecordBatch, int]]:
    mapped = _map(path)
    return [_in_place_batch(batch, mapped.buffer, vocab_size, max_length) for batch in _messages(mapped, _token_schema)]


def open_in_place(path: Path, *, vocab_size: int, max_length: int) -> tuple[Examples, int]:
    """(the pre-tokenized rows of ``path`` as the trainer's examples, their target tokens):
    ``path`` a ``save_to_disk`` directory or an ``.arrow`` file (:func:`arrow_files`),
    memory-mapped from the user's own files, nothing copied, each checked as a cache entry is.
    NotInPlace when some row would have to be cut or dropped; DataCacheError naming the file
    when it is no Arrow stream of token ids."""
    batches = []
    for file in arrow_files(path) or []:
        try:
            batches += _in_place_file(file, vocab_size, max_length)
        except DamagedFile as exc:
            raise DataCacheError(str(exc)) from None
        except (_Refused, OSError, ValueError, pa.ArrowException) as exc:
            raise DataCacheError(f"{visible(file)}: {visible(exc)[:300]}") from None
    if not sum(batch.num_rows for batch, _targets in batches):
        raise DataCacheError(f"{visible(path)}: holds no rows")
    if len({batch.schema for batch, _targets in batches}) > 1:
        raise DataCacheError(f"{visible(path)}: its data files disagree on the types of input_ids and labels")
    table = pa.Table.from_batches([batch for batch, _targets in batches])
    return Examples(table), sum(targets for _batch, targets in batches)
