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
