"""trainer.data.examples: every rank reads a cache entry with pyarrow alone, the same rows as
``datasets`` wrote them, and a damaged entry is one line naming its file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bounded import Outcome, bounded
from helpers import DATA, REPO

pytestmark = pytest.mark.torch
datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

import pyarrow as pa  # noqa: E402 - datasets' own dependency

from jobgen.spec.tables.data import DataSpec  # noqa: E402
from trainer.data.collective import prepare_dataset  # noqa: E402
from trainer.data.examples import DataCacheError, Examples  # noqa: E402
from trainer.data.stats import DataStats, read_stats  # noqa: E402


def alone(value: object) -> object:
    return value


@pytest.fixture(scope="module")
def entry(tiny_model, tmp_path_factory) -> Path:
    """A cache entry of the example data, as rank 0 builds it."""
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("examples")
    data = work / "instructions.jsonl"
    shutil.copy(DATA, data)
    spec = DataSpec(path=str(data), format="alpaca", max_length=256)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    _, _, entry = prepare_dataset(spec, tokenizer, tiny_model, work / "cache", rank=0, share=alone)
    return entry


def test_rows_columns_and_selections_equal_what_datasets_reads(entry):
    written = datasets.load_from_disk(str(entry / "dataset"))
    examples = Examples.open(entry / "dataset")
    assert len(examples) == len(written) == 400
    assert examples.column_names == written.column_names == ["input_ids", "labels", "length"]
    for name in examples.column_names:
        assert examples.column(name) == list(written[name])
    picked = [7, 399, 0, 7]
    assert examples.take(picked, ("input_ids", "labels")) == written.select_columns(["input_ids", "labels"])[picked]
    # A selection of a selection maps through both, as datasets' select does.
    inner, outer = [5, 3, 250, 1, 9], [4, 0, 2]
    nested, expected = examples.select(inner).select(outer), written.select(inner).select(outer)
    assert len(nested) == 3 and nested.column("length") == list(expected["length"])
    assert examples.lengths().tolist() == list(written["length"])  # as an array: no object per row
    assert nested.lengths().tolist() == list(expected["length"])
    assert nested.take([2, 0], ("labels",)) == {"labels": expected.select([2, 0])["labels"]}


def test_a_warm_start_reads_the_entry_without_importing_datasets_or_pandas(entry, tiny_model):
    """The cost this module exists for: a rank on a warm cache (the every-start case) imports
    neither (about a CPU-second on each rank of each launch)."""
    probe = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from jobgen.spec.tables.data import DataSpec\n"
        "from trainer.data.collective import prepare_dataset\n"
        "args = json.loads(sys.argv[1])\n"
        "tokenizer = AutoTokenizer.from_pretrained(args['model'])\n"
        "examples, stats, entry = prepare_dataset(DataSpec(**args['spec']), tokenizer, args['model'],\n"
        "    args['cache'], rank=0, share=lambda value: value)\n"
        "rows = examples.take([0, 1], ('input_ids',))\n"
        "print(json.dumps({'entry': str(entry), 'rows': len(examples),\n"
        "    'imported': sorted(m for m in ('datasets', 'pandas') if m in sys.modules)}))\n"
    )
    stats = json.loads((entry / "stats.json").read_text())
    spec = DataSpec(path=stats["source"], format="alpaca", max_length=256)
    args = {"model": str(tiny_model), "spec": spec.model_dump(), "cache": str(entry.parent)}
    out = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(args)], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"entry": str(entry), "rows": 400, "imported": []}


def damaged_copy(entry: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "dataset"
    shutil.copytree(entry / "dataset", copy)
    return copy


def test_a_truncated_arrow_file_is_one_line_naming_it(entry, tmp_path):
    copy = damaged_copy(entry, tmp_path)
    (arrow,) = copy.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    with pytest.raises(DataCacheError) as err:
        Examples.open(copy)
    assert str(err.value).startswith(f"{arrow}: not a readable Arrow stream") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("{not json", "not a readable dataset record"),
        (json.dumps({"_data_files": [{"filename": "../../elsewhere.arrow"}]}), "outside its directory"),
        (json.dumps({"_data_files": [{"filename": "/etc/passwd"}]}), "outside its directory"),
        (json.dumps({"_data_files": []}), "names no data files"),
        (json.dumps({"_data_files": [{"filename": "missing.arrow"}]}), "not a readable Arrow stream"),
    ],
)
def test_a_damaged_or_hostile_state_file_is_one_line_naming_it(entry, tmp_path, state, expected):
    copy = damaged_copy(entry, tmp_path)
    (copy / "state.json").write_text(state)
    with pytest.raises(DataCacheError, match=expected) as err:
        Examples.open(copy)
    assert str(copy) in str(err.value) and "\n" not in str(err.value)


def test_an_entry_without_the_trainers_columns_is_refused(entry, tmp_path):
    copy = damaged_copy(entry, tmp_path)
    written = datasets.load_from_disk(str(copy)).remove_columns(["labels"])
    other = tmp_path / "other"
    written.save_to_disk(str(other))
    with pytest.raises(DataCacheError, match="no column"):
        Examples.open(other)


# --------------------------------------------------------------------------- issue 45: a planted or damaged entry
# A teammate who can write the shared cache can plant an entry or damage one. Each test below
# ran against the reader before it validated an entry, and failed there as its comment says.

ROWS = ("input_ids", "labels")


def read_every_row(directory: Path, vocab_size: int | None = None) -> str:
    """What a rank does with an entry: open it, then read every row."""
    examples = Examples.open(directory, vocab_size=vocab_size) if vocab_size else Examples.open(directory)
    rows = examples.take(range(len(examples)), ROWS)
    return f"{len(examples)} rows, {sum(map(len, rows['input_ids']))} tokens"


def refused(outcome: Outcome, *expected: str) -> str:
    """The reader ended in one DataCacheError line holding each of ``expected``: no other
    exception, no signal, no hang."""
    assert outcome.error_type == "DataCacheError", outcome
    assert "\n" not in outcome.error and all(e in outcome.error for e in expected), outcome.error
    return outcome.error


def the_arrow_file(directory: Path) -> Path:
    (arrow,) = directory.glob("*.arrow")
    return arrow


def buffer_spans(arrow: Path) -> dict[str, list[tuple[int, int] | None]]:
    """Where each column's buffers lie in ``arrow``, (file offset, bytes) each: a list column's
    are [validity, offsets, values' validity, values], ``length``'s [validity, values]."""
    data = arrow.read_bytes()
    whole = pa.py_buffer(data)
    table = pa.ipc.open_stream(whole).read_all()  # zero-copy: each buffer is a slice of ``whole``
    spans = {}
    for name in table.column_names:
        (chunk,) = table.column(name).chunks
        spans[name] = [None if b is None else (b.address - whole.address, b.size) for b in chunk.buffers()]
    return spans


def edit_buffer(arrow: Path, column: str, index: int, change: Callable[[np.ndarray], None]) -> None:
    """``change`` one buffer of ``column`` in place (as int32 values), as a hostile writer would."""
    offset, size = buffer_spans(arrow)[column][index]
    data = bytearray(arrow.read_bytes())
    change(np.frombuffer(data, dtype=np.int32, count=size // 4, offset=offset))
    arrow.write_bytes(bytes(data))


def write_entry(directory: Path, columns: dict[str, pa.Array]) -> Path:
    """An entry laid out as save_to_disk lays it out, with ``columns`` as its one data file."""
    directory.mkdir()
    table = pa.table(columns)
    with (
        pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return directory


def set_offset(row: int, value: int) -> Callable[[np.ndarray], None]:
    def change(offsets: np.ndarray) -> None:
        offsets[row] = value

    return change


@pytest.mark.parametrize(
    ("column", "row", "value"),
    [
        # Old: SIGSEGV (take() copied row 399's 67M "tokens" from past the mapped file).
        ("input_ids", 400, 1 << 26),
        # Old: a MemoryError traceback under the bound (row 10 said 1 GiB); SIGSEGV without it.
        ("input_ids", 10, 1 << 28),
        # Old: SIGSEGV (a row starting before the values).
        ("input_ids", 0, -8),
        # Old: read silently, the last row's 1000 extra tokens from the bytes after its values.
        ("input_ids", 400, 60384 + 1000),
        # Old: read silently (row 9 of negative length, row 10 the labels of rows 0 to 10).
        ("labels", 10, 0),
    ],
)
def test_list_offsets_out_of_order_or_past_the_values_are_refused(entry, tmp_path, column, row, value):
    copy = damaged_copy(entry, tmp_path)
    edit_buffer(the_arrow_file(copy), column, 1, set_offset(row, value))
    error = refused(bounded(lambda: read_every_row(copy), seconds=20, extra_bytes=512 << 20), str(the_arrow_file(copy)))
    assert "offsets" in error


def test_rows_whose_ids_and_labels_or_length_disagree_are_refused(entry, tmp_path):
    """Old: opened; the packer then paired each token with another row's label."""
    copy = damaged_copy(entry, tmp_path)
    arrow = the_arrow_file(copy)
    spans = buffer_spans(arrow)
    offsets = np.frombuffer(arrow.read_bytes(), np.int32, spans["labels"][1][1] // 4, spans["labels"][1][0])
    edit_buffer(arrow, "labels", 1, set_offset(5, int(offsets[5]) + 1))  # still in order: one token moved rows
    with pytest.raises(DataCacheError, match="input_ids and labels") as err:
        Examples.open(copy)
    assert str(arrow) in str(err.value)

    copy = damaged_copy(entry, tmp_path / "length")
    edit_buffer(the_arrow_file(copy), "length", 1, lambda lengths: lengths.__setitem__(3, lengths[3] + 7))
    with pytest.raises(DataCacheError, match="length"):
        Examples.open(copy)


@pytest.mark.parametrize("what", ["the data file", "state.json"])
def test_a_fifo_in_the_entry_is_refused_not_a_hang(entry, tmp_path, what):
    """Old: hung (opening a FIFO for reading waits for a writer, forever)."""
    copy = damaged_copy(entry, tmp_path)
    target = the_arrow_file(copy) if what == "the data file" else copy / "state.json"
    target.unlink()
    os.mkfifo(target)
    refused(bounded(lambda: Examples.open(copy), seconds=10), str(target), "FIFO")


@pytest.mark.parametrize("to", ["a file elsewhere", "/dev/zero"])
def test_a_link_in_the_entry_is_refused_not_followed(entry, tmp_path, to):
    """Old: followed: a teammate's file read as this entry's, /dev/zero read (as no Arrow stream)."""
    copy = damaged_copy(entry, tmp_path)
    arrow = the_arrow_file(copy)
    elsewhere = tmp_path / "elsewhere.arrow"
    shutil.copy(arrow, elsewhere)
    arrow.unlink()
    arrow.symlink_to(elsewhere if to == "a file elsewhere" else Path(to))
    refused(bounded(lambda: Examples.open(copy), seconds=10), str(arrow), "symbolic link")


@pytest.mark.parametrize(
    ("name", "extra_bytes"),
    [
        # Old: read whole: a MemoryError under the bound (an OOM at 24 GB without it).
        ("state.json", 512 << 20),
        # Old: mapped and opened (the stream's end is where it was; zeros follow); a bound on
        # the address space below 64 GiB would refuse the map itself, so this one allows more.
        ("the data file", 80 << 30),
    ],
)
def test_a_huge_sparse_file_in_the_entry_is_refused_unread(entry, tmp_path, name, extra_bytes):
    copy = damaged_copy(entry, tmp_path)
    target = copy / "state.json" if name == "state.json" else the_arrow_file(copy)
    os.truncate(target, 64 << 30)  # sparse: no disk used
    refused(bounded(lambda: read_every_row(copy), seconds=20, extra_bytes=extra_bytes), str(target), "larger than")


def ids(values: list | None, type_: pa.DataType | None = None) -> pa.Array:
    return pa.array(values, pa.list_(type_ or pa.int32()))


GOOD = {"input_ids": ids([[1, 2], [3]]), "labels": ids([[-100, 2], [3]]), "length": pa.array([2, 1], pa.int32())}


@pytest.mark.parametrize(
    ("column", "array", "expected"),
    [
        ("input_ids", ids([[1.0, 2.0], [3.0]], pa.float32()), "input_ids"),
        ("input_ids", pa.array([["a", "b"], ["c"]]), "input_ids"),
        ("input_ids", pa.array([1, 2]), "input_ids"),
        ("labels", pa.array([[1, 2], [3]], pa.large_list(pa.int32())), "labels"),
        ("labels", ids([[1, 2], [3]], pa.int8()), "labels"),
        ("length", pa.array(["2", "1"]), "length"),
        ("length", pa.array([2.0, 1.0]), "length"),
        ("length", pa.array([2, None], pa.int32()), "null"),
        ("input_ids", ids([[1, 2], None]), "null"),
        ("labels", ids([[-100, None], [3]]), "null"),
    ],
)
def test_columns_of_the_wrong_type_or_with_nulls_are_refused(tmp_path, column, array, expected):
    """Old: opened; the trainer then failed on strings, floats or None in a batch, with a traceback."""
    directory = write_entry(tmp_path / "dataset", {**GOOD, column: array})
    with pytest.raises(DataCacheError, match=expected) as err:
        Examples.open(directory)
    assert str(directory / "data-00000-of-00001.arrow") in str(err.value) and "\n" not in str(err.value)


def test_a_synthetic_entry_of_the_right_types_opens(tmp_path):
    directory = write_entry(tmp_path / "dataset", {**GOOD, "input_ids": ids([[1, 2], [3]], pa.int64())})
    assert Examples.open(directory, vocab_size=4).take([1, 0], ROWS) == {
        "input_ids": [[3], [1, 2]],
        "labels": [[3], [-100, 2]],
    }


@pytest.mark.parametrize(
    ("column", "value", "vocab", "expected"),
    [
        ("input_ids", "vocab", "vocab", "input_ids"),  # one id past the vocabulary
        ("input_ids", -3, None, "input_ids"),  # no id is negative, vocabulary or not
        ("labels", "vocab", "vocab", "labels"),
        ("labels", -5, None, "labels"),  # -100 is the one negative label
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(entry, tmp_path, column, value, vocab, expected):
    """Old: opened (and had no vocab_size); the embedding lookup then failed in the first step,
    an index error on a CPU and a device-side assert on a GPU."""
    copy = damaged_copy(entry, tmp_path)
    arrow = the_arrow_file(copy)
    vocab_size = 1 + max(max(row) for row in Examples.open(copy).column("input_ids"))
    value = vocab_size if value == "vocab" else value
    edit_buffer(arrow, column, 3, lambda values: values.__setitem__(len(values) // 2, value))
    with pytest.raises(DataCacheError, match=expected) as err:
        Examples.open(copy, vocab_size=vocab_size if vocab else None)
    assert str(arrow) in str(err.value) and "\n" not in str(err.value)
    Examples.open(entry / "dataset", vocab_size=vocab_size)  # the undamaged entry's ids are all below it


STATS = {
    "examples_in": 400,
    "kept": 400,
    "truncated": 0,
    "dropped": 0,
    "total_tokens": 60384,
    "target_tokens": 3131,
    "longest": 195,
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[1, 2]", "not an object"),  # old: TypeError (list indices must be integers)
        ('"text"', "not an object"),  # old: TypeError
        ("{}", "examples_in"),  # old: KeyError
        (json.dumps({**STATS, "kept": "400"}), "kept"),  # old: taken, int("400")
        (json.dumps({**STATS, "kept": True}), "kept"),  # old: taken as 1
        (json.dumps({**STATS, "kept": 1.5}), "kept"),  # old: taken as 1
        (json.dumps({**STATS, "kept": -1}), "kept"),  # old: taken
        (json.dumps({**STATS, "kept": 10**30}), "kept"),  # old: taken
        (json.dumps(STATS).replace("60384", "1" + "0" * 400), "total_tokens"),  # old: taken
        (json.dumps(STATS).replace("60384", "1e400"), "total_tokens"),  # old: OverflowError
        (json.dumps(STATS)[:40], "invalid JSON"),  # old: JSONDecodeError
        (b"\xff\xfe".decode("latin-1"), "invalid JSON"),  # old: JSONDecodeError
    ],
)
def test_a_damaged_stats_file_is_one_line_naming_it(tmp_path, text, expected):
    path = tmp_path / "stats.json"
    path.write_text(text, encoding="latin-1")
    with pytest.raises(DataCacheError, match=expected) as err:
        read_stats(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_stats_of_the_wrong_types_are_no_data_stats():
    """DataStats.from_dict takes what stats.json holds only when each count is a count."""
    assert DataStats.from_dict({**STATS, "fingerprint": "abc", "inputs": {"x": 1}}) == DataStats(**STATS)
    for wrong in ([1, 2], "text", None, {**STATS, "kept": "4"}, {**STATS, "kept": False}, {**STATS, "kept": 4.0}):
        with pytest.raises(ValueError, match=r"kept|not an object"):
            DataStats.from_dict(wrong)


@pytest.mark.parametrize("what", ["a FIFO", "huge and sparse", "a link", "missing"])
def test_a_stats_file_that_is_no_small_regular_file_is_refused(tmp_path, what):
    """Old: a FIFO hung the start, a sparse file was read whole (MemoryError under the bound),
    a link was followed and a missing file was a FileNotFoundError traceback."""
    path = tmp_path / "stats.json"
    if what == "a FIFO":
        os.mkfifo(path)
    elif what == "huge and sparse":
        path.write_text(json.dumps(STATS))
        os.truncate(path, 64 << 30)
    elif what == "a link":
        (tmp_path / "elsewhere.json").write_text(json.dumps(STATS))
        path.symlink_to(tmp_path / "elsewhere.json")
    refused(bounded(lambda: read_stats(path), seconds=10), str(path))


def test_a_compressed_data_file_is_refused_before_it_is_decompressed(tmp_path):
    """A compressed buffer declares its own decompressed size, which pyarrow allocates: datasets
    writes none, so none is read. Old: opened, each buffer decompressed into memory."""
    directory = write_entry(tmp_path / "dataset", GOOD)
    arrow = the_arrow_file(directory)
    table = pa.table(GOOD)
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    with pytest.raises(DataCacheError, match="compressed") as err:
        Examples.open(directory)
    assert str(arrow) in str(err.value)
