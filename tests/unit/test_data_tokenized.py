"""``data.format = "tokenized"``: rows that are token ids already (``input_ids``, and ``labels``
optional) go through the same preparation as text, taken as they are: no prefix, no eos,
truncated to max_length and counted; a row that is no list of the tokenizer's ids is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import pyarrow as pa
import pyarrow.parquet as pq

from jobgen.base.owned_dir import OwnedDir
from jobgen.spec.tables.data import DataSpec
from trainer.data.cache import load_entry
from trainer.data.collective import prepare_dataset
from trainer.data.formats import DataError

ROWS = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
    {"input_ids": [9, 10, 11]},  # no labels: every token a target (but the first)
    {"input_ids": list(range(20, 40)), "labels": [-100] * 10 + list(range(30, 40))},  # longer than max_length
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def prepared(tokenizer, tiny_model, path: Path, tmp_path: Path, **keys):
    spec = DataSpec(path=str(path), format="tokenized", max_length=16, **keys)
    examples, stats, entry = prepare_dataset(spec, tokenizer, tiny_model, tmp_path / "cache", rank=0, share=lambda v: v)
    return examples, stats, entry


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_token_ids_are_taken_as_they_are(tokenizer, tiny_model, tmp_path, kind):
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist([{**{"labels": None}, **row} for row in ROWS]), path)
    else:
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_list([{**{"labels": None}, **row} for row in ROWS]).save_to_disk(str(path))
    examples, stats, entry = prepared(tokenizer, tiny_model, path, tmp_path)
    assert examples.column("input_ids") == [[5, 6, 7, 8], [9, 10, 11], list(range(20, 36))]
    assert examples.column("labels") == [[-100, -100, 7, 8], [-100, 10, 11], [-100] * 10 + list(range(30, 36))]
    assert (stats.examples_in, stats.kept, stats.truncated, stats.longest) == (3, 3, 1, 20)
    assert stats.total_tokens == 4 + 3 + 16 and stats.target_tokens == 2 + 2 + 6
    with OwnedDir.open(entry) as opened:  # a cache entry like any other: checked in full when read
        assert len(load_entry(opened, vocab_size=len(tokenizer))[0]) == 3


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"input_ids": [1, 2, "3"]}, "input_ids: '3' is not a token id of the tokenizer"),
        ({"input_ids": [1, 10**9]}, "input_ids: 1000000000 is not a token id of the tokenizer"),
        ({"input_ids": []}, "input_ids is empty, not a non-empty list of token ids"),
        ({"input_ids": [1, 2], "labels": [2]}, "labels has 1 tokens, input_ids 2"),
        ({"input_ids": [1, 2], "labels": [-5, 2]}, "labels: -5 is not a token id of the tokenizer"),
        ({"text": "words"}, "input_ids is missing (null), not a non-empty list of token ids"),
    ],
)
def test_a_row_that_is_no_token_ids_is_named(tokenizer, tiny_model, tmp_path, row, problem):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as refused:
        prepared(tokenizer, tiny_model, path, tmp_path)
    assert str(refused.value).startswith(f"data.path: {path}: row 1: {problem}"), str(refused.value)


def test_text_rows_are_refused_naming_the_column_the_format_needs(tokenizer, tiny_model, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "words"}) + "\n")
    with pytest.raises(DataError, match="format 'tokenized' needs column\\(s\\) 'input_ids'; the data has 'text'"):
        prepared(tokenizer, tiny_model, path, tmp_path)


# --------------------------------------------------------------------------- used in place

FITTING = [  # every row within max_length = 16 and with a target
    {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "source": "a"},
    {"input_ids": [9, 10, 11], "labels": [9, 10, 11], "source": "b"},
]


def arrow_file(path: Path, rows: list[dict], **types: pa.DataType) -> Path:
    """``rows`` as one Arrow stream file, as ``save_to_disk`` writes its data files."""
    schema = pa.schema([(name, types.get(name, pa.list_(pa.int32()))) for name in ("input_ids", "labels")])
    schema = schema.append(pa.field("source", pa.string()))  # a column the trainer does not read
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(pa.Table.from_pylist(rows, schema=schema))
    return path


def cache_entries(tmp_path: Path) -> list[str]:
    root = tmp_path / "cache"
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


@pytest.mark.parametrize("kind", ["arrow", "saved"])
def test_pre_tokenized_arrow_is_trained_on_where_it_lies(tokenizer, tiny_model, tmp_path, kind, caplog):
    if kind == "arrow":
        path = arrow_file(tmp_path / "d.arrow", FITTING)
    else:
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_list(FITTING).save_to_disk(str(path))
    with caplog.at_level("INFO", logger="trainer.data.collective"):
        examples, stats, entry = prepared(tokenizer, tiny_model, path, tmp_path)
    assert entry == path and cache_entries(tmp_path) == []  # nothing copied into the cache
    assert "used in place (memory-mapped, nothing copied): 2 rows, 7 tokens" in caplog.text
    assert examples.column("input_ids") == [r["input_ids"] for r in FITTING]
    assert examples.column("length") == [4, 3] and examples.column_names == ["input_ids", "labels", "length"]
    # The trainer's targets: those the labels give, never the first token (collate masks it).
    assert (stats.examples_in, stats.kept, stats.total_tokens, stats.target_tokens, stats.longest) == (2, 2, 7, 4, 4)


def test_in_place_trains_on_what_the_prepared_copy_would(tokenizer, tiny_model, tmp_path):
    from trainer.data.packing import collate, fetch_rows

    in_place, stats, _ = prepared(tokenizer, tiny_model, arrow_file(tmp_path / "d.arrow", FITTING), tmp_path / "a")
    copy_file = tmp_path / "d.jsonl"
    copy_file.write_text("".join(json.dumps(row) + "\n" for row in FITTING))
    copied, copied_stats, entry = prepared(tokenizer, tiny_model, copy_file, tmp_path / "b")
    assert entry.parent == tmp_path / "b" / "cache"  # a JSON Lines source is prepared, as before
    assert stats == copied_stats
    rows = [[0], [1]]
    for packing in (False, True):
        mine = collate(fetch_rows(in_place, rows, [0, 1]), pad_token_id=0, packing=packing)
        theirs = collate(fetch_rows(copied, rows, [0, 1]), pad_token_id=0, packing=packing)
        assert all(mine[k].equal(theirs[k]) for k in theirs), packing


@pytest.mark.parametrize(
    ("rows", "types", "why"),
    [
        ([*FITTING, ROWS[2]], {}, "a row has 20 tokens, more than max_length = 16: rows are cut"),
        ([*FITTING, {"input_ids": [1, 2], "labels": [-100, -100]}], {}, "a row has no target token"),
        ([*FITTING, {"input_ids": [1], "labels": [1]}], {}, "fewer than 2 tokens"),
        ([*FITTING, {"input_ids": [1, 2], "labels": None}], {}, "column labels has null rows"),
    ],
)
def test_rows_that_need_preparing_are_prepared_and_the_log_says_why(
    tokenizer, tiny_model, tmp_path, rows, types, why, caplog
):
    path = arrow_file(tmp_path / "d.arrow", rows, **types)
    with caplog.at_level("INFO", logger="trainer.data.collective"):
        examples, stats, entry = prepared(tokenizer, tiny_model, path, tmp_path)
    assert entry.parent == tmp_path / "cache" and len(examples) == stats.kept, caplog.text
    assert "not used in place" in caplog.text and why in caplog.text, caplog.text


def test_a_bad_token_id_in_arrow_is_named_by_the_preparation(tokenizer, tiny_model, tmp_path):
    path = arrow_file(tmp_path / "d.arrow", [*FITTING, {"input_ids": [1, 10**6], "labels": [1, 2]}])
    with pytest.raises(DataError, match=r"d\.arrow.*row 2: input_ids: 1000000 is not a token id"):
        prepared(tokenizer, tiny_model, path, tmp_path)


def test_opening_in_place_costs_no_memory_of_the_datas_size(tmp_path):
    """A 128 MiB file of token ids opened and checked in full: the process's resident memory
    grows by a fraction of it (the pages read are let go as the check goes)."""
    from helpers import python_checks

    path = tmp_path / "big.arrow"
    row = list(range(4, 4 + 1024))
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        batch = pa.RecordBatch.from_pylist([{"input_ids": row}] * 1024, schema=schema)  # 4 MiB
        for _ in range(32):
            writer.write_batch(batch)
    python_checks(
        f"""
import resource
from pathlib import Path
from trainer.data.examples import open_in_place

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20

before = rss_mib()
examples, targets = open_in_place(Path({str(path)!r}), vocab_size=2048, max_length=1024)
grown = rss_mib() - before
assert len(examples) == 32 * 1024 and targets == 32 * 1024 * 1023, (len(examples), targets)
assert grown < 32, f"resident memory grew by {{grown:.0f}} MiB opening 128 MiB in place"
"""
    )


def test_a_rank_that_maps_other_rows_than_rank_0_read_stops(tokenizer, tiny_model, tmp_path):
    """Rank 0 checked the Arrow and shared its counts; a rank that maps the files afterwards and
    finds others (rewritten in between) stops naming the path, never trains on other rows."""
    path = arrow_file(tmp_path / "d.arrow", FITTING)
    spec = DataSpec(path=str(path), format="tokenized", max_length=16)
    told = ("in place", (3, 10, 5, 4))  # what rank 0 read before the file was rewritten
    with pytest.raises(DataError, match=r"d\.arrow changed while the job read it: 2 rows where rank 0 read 3"):
        prepare_dataset(spec, tokenizer, tiny_model, tmp_path / "cache", rank=1, share=lambda value: told)
