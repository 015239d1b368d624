"""The rows of a data source, read by index range in bounded batches: what preparation streams.

A source is opened once (:func:`open_rows`) and is then a small, picklable description: the
files and, for JSON Lines, the byte offset of every :data:`INDEX_EVERY`-th row. Any process
(a tokenizing worker, another node) reads any range of rows from it without reading what
comes before, and never holds more than one batch of rows:

- JSON Lines (``.jsonl``, and ``.json`` files holding one object per line): read line by line
  from the indexed offset, each line ``json.loads``-ed by itself. A blank line is no row;
- Parquet: row groups located from the files' footers, read in record batches;
- everything else ``datasets`` reads (CSV, a JSON array, a ``save_to_disk`` directory, a hub
  dataset): loaded once by ``datasets`` (:mod:`trainer.data.source`) into Arrow files it
  memory-maps, then sliced.

Row *i* is the same row whichever way it is read, so the shards of a preparation are the
same whichever process or node tokenizes them.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jobgen.spec.data_files import data_files, is_empty_file, is_hub_id, is_saved_dataset
from trainer.data.formats import DataError

if TYPE_CHECKING:
    import datasets

# A JSON Lines file's index holds the offset of every this-many-th row: 8 bytes per 1,000 rows.
INDEX_EVERY = 1000
_READ_CHUNK = 1 << 20


def _is_json_lines(path: Path) -> bool:
    """Whether a ``.json`` file holds one object per line (as ``.jsonl`` does), judged by its
    first line; a JSON array or a pretty-printed object is read by ``datasets``."""
    if path.suffix == ".jsonl":
        return True
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict)
                except ValueError:
                    return False
    return False


@dataclass(frozen=True)
class JsonLinesFile:
    """One JSON Lines file: its rows and the byte offset of every INDEX_EVERY-th row."""

    path: str
    rows: int
    offsets: np.ndarray

    @classmethod
    def index(cls, path: Path, limit: int | None = None) -> JsonLinesFile:
        """One pass over the file: counts its rows and notes where every INDEX_EVERY-th starts;
        with ``limit``, the pass stops there (the file's first rows, as a file of its own)."""
        offsets, rows, position = [], 0, 0
        with open(path, "rb", buffering=_READ_CHUNK) as fh:
            for line in fh:
                if limit is not None and rows >= limit:
                    break
                if line.strip():
                    if rows % INDEX_EVERY == 0:
                        offsets.append(position)
                    rows += 1
                position += len(line)
        return cls(str(path), rows, np.asarray(offsets, dtype=np.int64))

    def read(self, start: int, stop: int, batch: int) -> Iterator[list[dict[str, Any]]]:
        """Rows [start, stop) of this file, ``batch`` at a time, each parsed."""
        skip = start % INDEX_EVERY
        with open(self.path, "rb", buffering=_READ_CHUNK) as fh:
            fh.seek(int(self.offsets[start // INDEX_EVERY]))
            rows: list[dict[str, Any]] = []
            index = start - skip
            for line in fh:
                if not line.strip():
                    continue
                if index >= stop:
                    break
                if index >= start:
                    rows.append(self._parse(line, index))
                    if len(rows) == batch:
                        yield rows
                        rows = []
                index += 1
            if rows:
                yield rows

    def _parse(self, line: bytes, index: int) -> dict[str, Any]:
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DataError(f"data.path: {self.path}: row {index} is not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise DataError(f"data.path: {self.path}: row {index} is a {type(row).__name__}, not an object")
        return row


@dataclass(frozen=True)
class ParquetFile:
    """One Parquet file: its rows and where each row group starts."""

    path: str
    rows: int
    group_starts: tuple[int, ...]

    @classmethod
    def index(cls, path: Path) -> ParquetFile:
        import pyarrow.parquet as pq

        metadata = pq.ParquetFile(path).metadata
        starts, rows = [], 0
        for group in range(metadata.num_row_groups):
            starts.append(rows)
            rows += metadata.row_group(group).num_rows
        return cls(str(path), rows, tuple(starts))

    def read(self, start: int, stop: int, batch: int) -> Iterator[list[dict[str, Any]]]:
        import pyarrow.parquet as pq

        first = max(0, bisect.bisect_right(self.group_starts, start) - 1)
        groups = [g for g in range(first, len(self.group_starts)) if self.group_starts[g] < stop]
        index = self.group_starts[first] if groups else stop
        pending: list[dict[str, Any]] = []
        for record_batch in pq.ParquetFile(self.path).iter_batches(batch_size=batch, row_groups=groups):
            low, high = max(start - index, 0), min(stop - index, record_batch.num_rows)
            index += record_batch.num_rows
            if high > low:
                pending += record_batch.slice(low, high - low).to_pylist()
            while len(pending) >= batch:
                yield pending[:batch]
                pending = pending[batch:]
            if index >= stop:
                break
        if pending:
            yield pending


@dataclass(frozen=True)
class ArrowRows:
    """Rows ``datasets`` loaded (memory-mapped Arrow files): sliced, never copied whole."""

    dataset: datasets.Dataset

    @property
    def rows(self) -> int:
        return len(self.dataset)

    def read(self, start: int, stop: int, batch: int) -> Iterator[list[dict[str, Any]]]:
        for low in range(start, stop, batch):
            columns = self.dataset[low : min(low + batch, stop)]
            names = list(columns)
            yield [{name: columns[name][k] for name in names} for k in range(len(columns[names[0]]))]


@dataclass(frozen=True)
class RowSource:
    """A source's rows, in order, across its files; read by global row index."""

    path: str
    parts: tuple[Any, ...]  # JsonLinesFile | ParquetFile | ArrowRows, each with .rows and .read
    starts: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.starts[-1] + self.parts[-1].rows if self.parts else 0

    def column_names(self, sample: int = 1000) -> list[str]:
        """The columns: a loaded dataset's, else those the first ``sample`` rows have."""
        first = self.parts[0] if self.parts else None
        if isinstance(first, ArrowRows):
            return list(first.dataset.column_names)
        return list(dict.fromkeys(name for row in self.head(sample) for name in row))

    def head(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` rows."""
        return [row for rows in self.read(0, min(count, self.rows), count) for row in rows]

    def read(self, start: int, stop: int, batch: int) -> Iterator[list[dict[str, Any]]]:
        """Rows [start, stop) in batches of at most ``batch`` (a batch never spans two files)."""
        for part, first in zip(self.parts, self.starts):
            low, high = max(start, first), min(stop, first + part.rows)
            if low < high:
                yield from part.read(low - first, high - first, batch)


def _source(path: str, parts: list[Any]) -> RowSource:
    starts, total = [], 0
    for part in parts:
        starts.append(total)
        total += part.rows
    return RowSource(path, tuple(parts), tuple(starts))


def _files_read_row_by_row(path: str) -> list[Path] | None:
    """The files of a local source this module reads itself (JSON Lines, Parquet), else None."""
    p = Path(path).expanduser()
    if is_hub_id(path) or not p.exists() or (p.is_dir() and is_saved_dataset(p)):
        return None
    files = [f for f in data_files(p) if not is_empty_file(f)] if p.is_dir() else [p]
    if files and all(f.suffix in (".jsonl", ".json") and _is_json_lines(f) for f in files):
        return files
    if files and all(f.suffix == ".parquet" for f in files):
        return files
    return None


def reads_rows_itself(path: str) -> bool:
    """Whether the rows of ``path`` are read here row by row (no ``datasets`` conversion first)."""
    return _files_read_row_by_row(path) is not None


def first_rows(path: str, count: int = 1000) -> RowSource:
    """The first ``count`` rows of a source this module reads itself (:func:`reads_rows_itself`),
    without reading the rest: what a look at its columns needs (an index of the whole source is
    a pass over all of it)."""
    files = _files_read_row_by_row(path)
    assert files is not None, path
    if files[0].suffix == ".parquet":
        return _checked(path, _source(path, [_parquet(files[0])]))  # its footer: no row read
    return _checked(path, _source(path, [JsonLinesFile.index(files[0], limit=count)]))


def open_rows(path: str, *, cache_dir: str | Path | None = None, loaded: datasets.Dataset | None = None) -> RowSource:
    """The rows of ``[data] path``; ``cache_dir``: where ``datasets`` may write the Arrow files
    of a source it must convert (a private directory); ``loaded``: the rows, when the caller
    had to load them already (a hub dataset, to fingerprint it). DataError naming the path."""
    if loaded is not None:
        return _source(path, [ArrowRows(loaded)])
    files = _files_read_row_by_row(path)
    if files is not None and files[0].suffix == ".parquet":
        return _checked(path, _source(path, [_parquet(f) for f in files]))
    if files is not None:
        return _checked(path, _source(path, [JsonLinesFile.index(f) for f in files]))
    from trainer.data.source import load_raw  # imports datasets: only the formats it converts

    return _source(path, [ArrowRows(load_raw(path, cache_dir=cache_dir))])


def _parquet(path: Path) -> ParquetFile:
    try:
        return ParquetFile.index(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"data.path: could not read {path} as parquet: {exc}") from None


def _checked(path: str, source: RowSource) -> RowSource:
    if source.rows == 0:
        raise DataError(f"data.path: {Path(path).expanduser()} is empty (0 rows)")
    return source
