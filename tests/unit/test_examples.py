"""trainer.data.examples: every rank reads a cache entry with pyarrow alone, the same rows as
``datasets`` wrote them, and a damaged entry is one line naming its file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DATA, REPO

pytestmark = pytest.mark.torch
datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

from jobgen.spec.tables.data import DataSpec  # noqa: E402
from trainer.data.cache import prepare_dataset  # noqa: E402
from trainer.data.examples import DataCacheError, Examples  # noqa: E402


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
    assert nested.take([2, 0], ("labels",)) == {"labels": expected.select([2, 0])["labels"]}


def test_a_warm_start_reads_the_entry_without_importing_datasets_or_pandas(entry, tiny_model):
    """The cost this module exists for: a rank on a warm cache (the every-start case) imports
    neither (about a CPU-second on each rank of each launch)."""
    probe = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from jobgen.spec.tables.data import DataSpec\n"
        "from trainer.data.cache import prepare_dataset\n"
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
