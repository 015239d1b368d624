"""trainer.data.rows: any range of a source's rows, read without what comes before it, is the
same rows in the same order whichever way the source is stored."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pyarrow")

import pyarrow as pa
import pyarrow.parquet as pq

import trainer.data.rows as rows_module
from trainer.data.formats import DataError
from trainer.data.rows import open_rows

ROWS = [{"instruction": f"row {i}", "output": "x" * (i % 5 + 1)} for i in range(47)]


def every(source, batch: int) -> list[dict]:
    return [row for rows in source.read(0, source.rows, batch) for row in rows]


@pytest.fixture(autouse=True)
def small_index(monkeypatch):
    monkeypatch.setattr(rows_module, "INDEX_EVERY", 5)  # ranges start between and on indexed rows


def write_jsonl(path, rows, *, blank_every: int = 0):
    lines = []
    for i, row in enumerate(rows):
        lines.append(json.dumps(row) + "\n")
        if blank_every and i % blank_every == 0:
            lines.append("\n   \n")  # blank lines are no rows
    path.write_text("".join(lines))
    return path


def test_jsonl_ranges_are_the_rows_whatever_the_batch_and_the_blank_lines(tmp_path):
    source = open_rows(str(write_jsonl(tmp_path / "d.jsonl", ROWS, blank_every=4)))
    assert source.rows == len(ROWS) and every(source, 7) == ROWS
    for start, stop in [(0, 1), (3, 12), (5, 10), (44, 47), (46, 47), (12, 12)]:
        got = [row for rows in source.read(start, stop, 4) for row in rows]
        assert got == ROWS[start:stop], (start, stop)
        assert all(len(rows) <= 4 for rows in source.read(start, stop, 4))


def test_a_directory_of_files_and_parquet_row_groups_read_as_one_source(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", ROWS[:20])
    write_jsonl(tmp_path / "d" / "b.jsonl", ROWS[20:])
    (tmp_path / "d" / "c.jsonl").write_text("")  # an empty part of a sharded export
    directory = open_rows(str(tmp_path / "d"))
    assert every(directory, 6) == ROWS
    assert [row for rows in directory.read(17, 23, 10) for row in rows] == ROWS[17:23]

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet", row_group_size=9)
    parquet = open_rows(str(tmp_path / "d.parquet"))
    assert len(parquet.parts[0].group_starts) == 6 and every(parquet, 4) == ROWS
    for start, stop in [(0, 9), (8, 19), (9, 10), (40, 47)]:
        assert [row for rows in parquet.read(start, stop, 4) for row in rows] == ROWS[start:stop]


def test_other_formats_go_through_datasets_and_agree(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(ROWS))  # a JSON array: not JSON Lines
    array = open_rows(str(tmp_path / "d.json"), cache_dir=tmp_path / "hf")
    assert type(array.parts[0]).__name__ == "ArrowRows" and every(array, 10) == ROWS
    assert array.column_names() == ["instruction", "output"]


def test_a_line_that_is_no_object_is_named_by_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:8])
    path.write_text(path.read_text() + "[1, 2]\n")
    source = open_rows(str(path))
    with pytest.raises(DataError, match=rf"^data.path: {path}: row 8 is a list, not an object$"):
        every(source, 3)
    path.write_text(path.read_text().replace("[1, 2]", '{"instruction": '))
    with pytest.raises(DataError, match=rf"^data.path: {path}: row 8 is not JSON \("):
        every(open_rows(str(path)), 3)


def test_a_look_at_the_columns_reads_the_first_rows_alone(tmp_path, monkeypatch):
    from trainer.data.rows import first_rows

    path = write_jsonl(tmp_path / "d.jsonl", ROWS, blank_every=3)
    lines = []
    real_index = rows_module.JsonLinesFile.index.__func__

    def counted(cls, file, limit=None):
        found = real_index(cls, file, limit)
        lines.append(found.rows)
        return found

    monkeypatch.setattr(rows_module.JsonLinesFile, "index", classmethod(counted))
    head = first_rows(str(path), 10)
    assert lines == [10] and head.rows == 10 and every(head, 4) == ROWS[:10]
    assert head.column_names() == ["instruction", "output"]
    parquet = tmp_path / "p"
    parquet.mkdir()
    for k in range(2):
        pq.write_table(pa.Table.from_pylist(ROWS[k * 20 : k * 20 + 20]), parquet / f"{k}.parquet", row_group_size=7)
    assert first_rows(str(parquet)).rows == 20  # the first file's footer, not every file's
