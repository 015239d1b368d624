"""The tokenized examples as every rank reads them: a cache entry's Arrow files, memory-mapped
with pyarrow (:class:`Examples`).

Rank 0 writes an entry with ``datasets`` (:mod:`trainer.data.build`, ``save_to_disk``: a
``state.json`` naming Arrow stream files); every rank of every launch then only reads it. The
read needs nothing of ``datasets`` but its file layout, and importing ``datasets`` cost each
rank about a CPU-second at every start (a relaunch, each task of an array, each rank), so
ranks read the files with pyarrow alone and a start on a warm cache never imports ``datasets``.

A shared cache a teammate can write is data, never code: this reads JSON and Arrow IPC
streams, nothing else; a file named outside the entry's directory, a missing or unreadable
file is a :class:`DataCacheError` naming it, in one line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

# The columns trainer.data.build writes and the trainer reads.
COLUMNS = ("input_ids", "labels", "length")


def _row_numbers(rows: np.ndarray) -> pa.Array:
    """``rows`` as an Arrow int64 array over the same memory. Not ``pa.array``: it imports pandas
    (half a CPU-second, on every rank) to ask whether its argument is a pandas object."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])


class DataCacheError(RuntimeError):
    """The data cache could not be built, found or read; the message says which rank or file."""


class Examples:
    """Tokenized examples (``input_ids``, ``labels``, ``length``), in order, or a selection of them."""

    def __init__(self, table: pa.Table, indices: np.ndarray | None = None):
        """``table``: the examples; ``indices``: the rows of it this selection holds, in order
        (default all)."""
        self._table = table
        self._indices = indices

    @classmethod
    def open(cls, directory: Path) -> Examples:
        """The examples ``datasets``' ``save_to_disk`` wrote into ``directory``, memory-mapped."""
        state_file = directory / "state.json"
        try:
            state = json.loads(state_file.read_text())
            names = [entry["filename"] for entry in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataCacheError(f"{state_file}: not a readable dataset record ({exc})") from None
        tables = []
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise DataCacheError(f"{state_file}: names a data file outside its directory: {name!r}")
            path = directory / name
            try:
                with pa.memory_map(str(path)) as source:
                    tables.append(pa.ipc.open_stream(source).read_all())
            except (OSError, pa.ArrowException) as exc:
                raise DataCacheError(f"{path}: not a readable Arrow stream ({exc})") from None
        if not tables:
            raise DataCacheError(f"{state_file}: names no data files")
        try:
            table = pa.concat_tables(tables)
        except pa.ArrowException as exc:
            raise DataCacheError(f"{directory}: its data files disagree on their columns ({exc})") from None
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise DataCacheError(f"{directory}: no column(s) {', '.join(missing)} in its data files")
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
