"""Fuzzing the cache entry reader (issue 45): a teammate who can write a shared data cache can
plant or damage an entry, and whatever they put there, a rank either reads it as the trainer's
data or stops with one DataCacheError line, never another exception, a signal, a hang or a
MemoryError.

From a valid small entry (the example data tokenized with the tiny model, as test_examples.py
builds it), each case applies one to three seeded mutations: bytes flipped anywhere or in the
Arrow messages' metadata (flatbuffers, field nodes, buffer descriptors, length prefixes), the
file cut short, list offsets, token ids and lengths edited in place, the stream rewritten with
another schema (types, columns, nulls, dictionaries, compression, batches), ``state.json`` and
``stats.json`` damaged as tests/damage.py damages a run's files, and a FIFO, a directory or a link
put in place of any of them. Each case then runs in :func:`bounded.bounded` (a forked child,
a time and an address-space limit): the entry is opened with the vocabulary's size, its stats
read, and if it opened every row is read through ``take`` and checked (ids within the
vocabulary, labels too or -100, ``length`` the row's tokens).

The run stops after :data:`CASES` cases or :data:`SECONDS` seconds, whichever comes first; the
cases are the same for the same seed. To fuzz longer locally::

    JOBGEN_FUZZ_SECONDS=600 JOBGEN_FUZZ_SEED=7 .venv/bin/python -m pytest -n 0 tests/unit/test_fuzz_cache_entry.py

(``JOBGEN_FUZZ_SECONDS`` lifts the case count too). A failing case is named by its number and
its mutations; ``JOBGEN_FUZZ_SEED`` and the number make it again (:func:`make_case`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bounded import Outcome, bounded
from damage import SPECIAL, Damage, json_damages, place, remove
from helpers import DATA

pytestmark = pytest.mark.torch
pytest.importorskip("datasets")
pytest.importorskip("transformers")

import pyarrow as pa  # noqa: E402 - datasets' own dependency
import pyarrow.compute as pc  # noqa: E402

from jobgen.spec.tables.data import DataSpec  # noqa: E402
from trainer.data.collective import prepare_dataset  # noqa: E402
from trainer.data.examples import Examples  # noqa: E402
from trainer.data.stats import read_stats  # noqa: E402

SEED = int(os.environ.get("JOBGEN_FUZZ_SEED", "45"))
SECONDS = float(os.environ.get("JOBGEN_FUZZ_SECONDS", "8"))
CASES = 10**9 if "JOBGEN_FUZZ_SECONDS" in os.environ else 300
# What one case may take: a reader that needs more hangs.
CASE_SECONDS = 10
ARROW = "data-00000-of-00001.arrow"
# Values an edited offset, id or length takes: the edges of int32, of the values, of a label.
EDGES = (-(2**31), -(2**31) + 1, -101, -100, -99, -1, 0, 1, 2**31 - 1, 2**30, 2**16)


@dataclass(frozen=True)
class Valid:
    """The valid entry every case starts from: its files' bytes, where each Arrow buffer and
    message lies in its data file, its table and the vocabulary's size."""

    state: bytes
    stats: bytes
    arrow: bytes
    info: bytes
    table: pa.Table
    buffers: dict[str, list[tuple[int, int] | None]]  # per column: (file offset, bytes) of each buffer
    metadata: list[tuple[int, int]]  # (start, end) of each message's flatbuffer, its length prefix before it
    vocab_size: int
    state_damages: list[Damage]
    stats_damages: list[Damage]


def alone(value: object) -> object:
    return value


@pytest.fixture(scope="module")
def valid(tiny_model, tmp_path_factory) -> Valid:
    """A cache entry of the example data, as rank 0 builds it (test_examples.py's entry)."""
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("fuzz-entry")
    data = work / "instructions.jsonl"
    shutil.copy(DATA, data)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    spec = DataSpec(path=str(data), format="alpaca", max_length=256)
    _, _, entry = prepare_dataset(spec, tokenizer, tiny_model, work / "cache", rank=0, share=alone)
    arrow = (entry / "dataset" / ARROW).read_bytes()
    whole = pa.py_buffer(arrow)
    table = pa.ipc.open_stream(whole).read_all()  # zero-copy: each buffer a slice of ``whole``
    buffers = {
        name: [
            None if b is None else (b.address - whole.address, b.size) for b in table.column(name).chunk(0).buffers()
        ]
        for name in table.column_names
    }
    metadata = []
    for message in pa.ipc.MessageReader.open_stream(whole):
        start = message.metadata.address - whole.address
        metadata.append((start, start + message.metadata.size))
    state, stats = (entry / "dataset" / "state.json").read_bytes(), (entry / "stats.json").read_bytes()
    specials = [Damage(what, special=what) for what in SPECIAL]
    return Valid(
        state=state,
        stats=stats,
        arrow=arrow,
        info=(entry / "dataset" / "dataset_info.json").read_bytes(),
        table=table,
        buffers=buffers,
        metadata=metadata,
        vocab_size=len(tokenizer),
        state_damages=[*json_damages(state), *specials],
        stats_damages=[*json_damages(stats), *specials],
    )


# --------------------------------------------------------------------------- mutations of the data file


def flip_bytes(rng: random.Random, data: bytearray, valid: Valid) -> str:
    where = rng.choice(["anywhere", "metadata"])
    spans = [(0, len(data))] if where == "anywhere" else [(max(0, a - 8), b) for a, b in valid.metadata]
    count = rng.choice([1, 1, 2, 4, 16])
    for _ in range(count):
        start, end = rng.choice(spans)
        if end > start and end <= len(data):
            data[rng.randrange(start, end)] ^= rng.randrange(1, 256)
    return f"{count} byte(s) flipped {where}"


def set_int32(rng: random.Random, data: bytearray, valid: Valid) -> str:
    """An offset, a token id or a length set to an edge value or a neighbour's."""
    column = rng.choice(["input_ids", "labels", "length"])
    index = 1 if column == "length" else rng.choice([1, 1, 3])  # offsets twice as often as values
    offset, size = valid.buffers[column][index]
    if offset + size > len(data):
        return f"{column} buffer {index} gone (cut before)"
    count = size // 4
    at = rng.choice([0, count - 1, rng.randrange(count)])
    (old,) = struct.unpack_from("<i", data, offset + 4 * at)
    new = rng.choice([*EDGES, old - 1, old + 1, old * 2, valid.vocab_size, valid.vocab_size - 1, count])
    new = max(-(2**31), min(2**31 - 1, new))
    struct.pack_into("<i", data, offset + 4 * at, new)  # not a numpy view: a later resize needs no export
    return f"{column} buffer {index}[{at}] = {new} (was {old})"


def cut(rng: random.Random, data: bytearray, valid: Valid) -> str:
    if len(data) < 2:
        return "cut: already empty"
    at = rng.choice([0, 4, 8, rng.randrange(len(data)), len(data) - 8, len(data) - 1])
    del data[at:]
    return f"cut at byte {at}"


def append(rng: random.Random, data: bytearray, valid: Valid) -> str:
    what = rng.choice(["the stream again", "its last message again", "garbage", "another schema"])
    if what == "the stream again":
        data += bytes(data[:-8] if rng.random() < 0.5 else data)  # a copy: a bytearray cannot grow by itself
    elif what == "its last message again":
        data[-8:-8] = valid.arrow[valid.metadata[-1][0] - 8 : -8]
    elif what == "garbage":
        data += rng.randbytes(rng.choice([1, 7, 64, 4096]))
    else:
        data[-8:-8] = valid.arrow[: valid.metadata[1][0] - 8]
    return f"appended {what}"


DATA_MUTATIONS: tuple[Callable[[random.Random, bytearray, Valid], str], ...] = (
    flip_bytes,
    flip_bytes,
    set_int32,
    set_int32,
    set_int32,
    cut,
    append,
)


def nulls(array: pa.Array, rng: random.Random) -> pa.Array:
    mask = pa.array([rng.random() < 0.1 for _ in range(len(array))])
    return pc.if_else(mask, pa.scalar(None, array.type), array)


def rewritten(rng: random.Random, valid: Valid) -> tuple[bytes, str]:
    """The entry's table written again with another schema, or in other batches or compressed."""
    table = valid.table
    column = rng.choice(table.column_names)
    at = table.column_names.index(column)
    list_type = rng.choice(
        [pa.list_(pa.int64()), pa.list_(pa.int16()), pa.large_list(pa.int32()), pa.list_(pa.float32())]
    )
    changes = {
        "cast to another type": lambda: table.set_column(
            at, column, table.column(column).cast(list_type if column != "length" else rng.choice(SCALARS), safe=False)
        ),
        "as strings": lambda: table.set_column(at, column, table.column(column).cast(pa.string())),
        "dropped": lambda: table.drop_columns([column]),
        "renamed": lambda: table.rename_columns([c if c != column else column.upper() for c in table.column_names]),
        "twice": lambda: table.append_column(column, table.column(column)),
        "an extra column": lambda: table.append_column("extra", table.column(column)),
        "moved first": lambda: table.select([column, *(c for c in table.column_names if c != column)]),
        "with nulls": lambda: table.set_column(at, column, nulls(table.column(column).combine_chunks(), rng)),
        "dictionary-encoded": lambda: table.set_column(at, column, table.column(column).dictionary_encode()),
        "in a struct": lambda: table.set_column(
            at, column, pa.StructArray.from_arrays([table.column(column).combine_chunks()], names=["x"])
        ),
        "no rows": lambda: table.slice(0, 0),
        "some rows": lambda: table.slice(rng.randrange(len(table)), rng.randrange(1, 50)),
    }
    what = rng.choice([*changes, "in small batches", "compressed"])
    options, batch = pa.ipc.IpcWriteOptions(), None
    if what == "compressed":
        options = pa.ipc.IpcWriteOptions(compression=rng.choice(["zstd", "lz4"]))
    elif what == "in small batches":
        batch = rng.choice([1, 7, 100])
    else:
        try:
            table = changes[what]()
        except pa.ArrowException:  # a cast pyarrow has not: the table as it was
            what += " (not possible: unchanged)"
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=batch)
    return sink.getvalue().to_pybytes(), f"rewritten: {column} {what}"


SCALARS = (pa.int64(), pa.int16(), pa.uint32(), pa.float64(), pa.bool_())
LISTS = (pa.list_(pa.int64()), pa.list_(pa.int16()), pa.large_list(pa.int32()), pa.list_(pa.float32()))


# --------------------------------------------------------------------------- a case


def make_case(number: int, valid: Valid, directory: Path) -> list[str]:
    """Case ``number``: the valid entry in ``directory`` with its mutations; what they were."""
    rng = random.Random(f"{SEED}-{number}")
    dataset = directory / "dataset"
    if directory.exists():
        for path in (dataset / "state.json", dataset / ARROW, directory / "stats.json", dataset / "second.arrow"):
            remove(path)
    dataset.mkdir(parents=True, exist_ok=True)
    (dataset / "dataset_info.json").write_bytes(valid.info)
    state, stats, arrow, extra = valid.state, valid.stats, bytearray(valid.arrow), None
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.choices(["data", "rewrite", "state", "stats", "two files", "special"], [10, 4, 2, 2, 1, 1])[0]
        if kind == "data":
            done.append(rng.choice(DATA_MUTATIONS)(rng, arrow, valid))
        elif kind == "rewrite":
            rewrite, what = rewritten(rng, valid)
            arrow[:] = rewrite
            done.append(what)
        elif kind in ("state", "stats"):
            damage = rng.choice(valid.state_damages if kind == "state" else valid.stats_damages)
            state, stats = (damage, stats) if kind == "state" else (state, damage)
            done.append(f"{kind}.json: {damage.what}")
        elif kind == "two files":
            extra = bytes(arrow)
            names = rng.choice([[ARROW, "second.arrow"], [ARROW, ARROW], ["second.arrow"], [ARROW, "../" + ARROW]])
            state = json.dumps({"_data_files": [{"filename": n} for n in names]}).encode()
            done.append(f"state.json names {names}")
        else:
            done.append(f"the data file is {rng.choice(SPECIAL)}")
    (dataset / ARROW).write_bytes(bytes(arrow))
    if extra is not None:
        (dataset / "second.arrow").write_bytes(extra)
    for path, content in ((dataset / "state.json", state), (directory / "stats.json", stats)):
        if isinstance(content, Damage):
            place(path, content, directory.parent)
        else:
            path.write_bytes(content)
    for what in done:
        if what.startswith("the data file is "):
            place(dataset / ARROW, Damage(what, special=what.removeprefix("the data file is ")), directory.parent)
    return done


def read_entry(directory: Path, vocab_size: int) -> str:
    """What a rank does with an entry (load_entry, then batches): open it, read its stats, read
    every row; and what the rows must then be."""
    examples = Examples.open(directory / "dataset", vocab_size=vocab_size)
    read_stats(directory / "stats.json")
    rows = examples.take(range(len(examples)), ("input_ids", "labels", "length"))
    for ids, labels, length in zip(rows["input_ids"], rows["labels"], rows["length"], strict=True):
        assert len(ids) == len(labels) == length, (len(ids), len(labels), length)
        assert all(0 <= t < vocab_size for t in ids), ids
        assert all(0 <= t < vocab_size or t == -100 for t in labels), labels
    assert examples.column("length") == rows["length"]
    return f"opened: {len(examples)} rows"


def verdict(outcome: Outcome) -> str | None:
    """Why ``outcome`` is wrong, in one line (None when it opened or was one DataCacheError line)."""
    if outcome.returned:
        return None
    if outcome.error_type == "DataCacheError" and "\n" not in (outcome.error or ""):
        return None
    if outcome.hung:
        return "hung"
    if outcome.signal:
        return f"killed by signal {outcome.signal}"
    return f"{outcome.error_type}: {(outcome.error or '').splitlines()[0] if outcome.error else ''}"[:300]


def test_every_mutated_entry_opens_or_is_one_data_cache_error(valid, tmp_path):
    started = time.monotonic()
    failures, first_traceback, counts = [], "", {"opened": 0, "refused": 0}
    number, directory = 0, tmp_path / "entry"  # each case made in the same place
    while number < CASES and time.monotonic() - started < SECONDS:
        done = make_case(number, valid, directory)
        outcome = bounded(lambda: read_entry(directory, valid.vocab_size), seconds=CASE_SECONDS, extra_bytes=512 << 20)
        wrong = verdict(outcome)
        if wrong:
            failures.append(f"case {number} ({'; '.join(done)}): {wrong}")
            first_traceback = first_traceback or outcome.traceback
        else:
            counts["opened" if outcome.returned else "refused"] += 1
        number += 1
    assert not failures, (
        f"{len(failures)} of {number} cases (seed {SEED}):\n" + "\n".join(failures[:20]) + "\n" + first_traceback
    )
    # The fuzz reaches both ends: mutations the reader takes (ids still in range, int64 ids,
    # other batches) and mutations it refuses.
    assert counts["opened"] and counts["refused"], counts
    print(f"{number} cases in {time.monotonic() - started:.1f} s: {counts}")
