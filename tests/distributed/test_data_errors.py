"""Issue 9 (data side): a run whose data or tokenizer cannot work is refused as early as
possible, naming the file and the key: `jobgen validate` (and so `submit`) for what file
sizes and names show, the trainer's first seconds for what needs the tokenizer or the rows.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers import DATA, jobgen, make_run, run_spec, torchrun
from jobgen.base.exit_codes import ExitCode
from jobgen.spec.loader import SpecError, load_run


def spec_with_data(tmp_path: Path, data: Path) -> Path:
    return run_spec(
        tmp_path, "t", job={"time": "1h", "runs_root": "runs"}, model={"path": tmp_path}, data={"path": data}
    )


# --------------------------------------------------------------------------- at validate (no torch)


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["zero-bytes", "blank-lines"])
def test_validate_refuses_an_empty_data_file(tmp_path, content):
    data = tmp_path / "train.jsonl"
    data.write_text(content)
    with pytest.raises(SpecError) as info:
        load_run(spec_with_data(tmp_path, data))
    issues = [(i.key, i.message) for i in info.value.issues]
    assert ("data.path", f"{data} is empty (0 rows)") in issues, issues


def test_validate_refuses_a_data_directory_whose_files_are_all_empty(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-0.csv").write_text("instruction,output\n")  # header only
    (shards / "part-1.csv").write_text("")
    with pytest.raises(SpecError) as info:
        load_run(spec_with_data(tmp_path, shards))
    [issue] = [i for i in info.value.issues if i.key == "data.path"]
    assert issue.message.startswith(f"{shards} is empty (0 rows)"), issue.message
    assert "part-0.csv" in issue.message and "part-1.csv" in issue.message


def test_validate_accepts_a_data_directory_with_some_empty_shards(tmp_path):
    # Spark and friends write empty part files for empty partitions: no rows, nothing wrong.
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-0.jsonl").write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n")
    (shards / "part-1.jsonl").write_text("")
    load_run(spec_with_data(tmp_path, shards))


def test_jobgen_validate_exits_non_zero_on_an_empty_data_file(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    proc = jobgen("validate", str(spec_with_data(tmp_path, data)))
    assert proc.returncode != 0
    assert f"data.path: {data} is empty (0 rows)" in proc.stdout + proc.stderr


def test_validate_accepts_the_example_data(tmp_path):
    load_run(spec_with_data(tmp_path, DATA))


# --------------------------------------------------------------------------- in the trainer


@pytest.fixture
def tokenizer_without_pad_or_eos(tiny_model, tmp_path) -> Path:
    """The tiny model with pad_token and eos_token removed from its tokenizer config."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("eos_token", None)
    config.pop("pad_token", None)
    config_file.write_text(json.dumps(config))
    special = model / "special_tokens_map.json"
    if special.exists():
        special.write_text(
            json.dumps(
                {k: v for k, v in json.loads(special.read_text()).items() if k not in ("eos_token", "pad_token")}
            )
        )
    return model


@pytest.mark.torch
def test_tokenizer_without_pad_or_eos_is_refused_naming_model_path(tokenizer_without_pad_or_eos):
    pytest.importorskip("transformers")
    from trainer.model.build import load_tokenizer
    from trainer.model.errors import ModelError

    with pytest.raises(Exception) as info:
        load_tokenizer(str(tokenizer_without_pad_or_eos))
    assert isinstance(info.value, ModelError)
    message = str(info.value)
    assert f"model.path: {tokenizer_without_pad_or_eos}" in message
    assert "neither a pad token nor an eos token" in message and "eos_token" in message


@pytest.mark.torch
def test_trainer_stops_on_such_a_tokenizer_before_data_and_model(tmp_path, tokenizer_without_pad_or_eos):
    pytest.importorskip("transformers")
    run = make_run(tmp_path / "r", tokenizer_without_pad_or_eos, max_steps=2)
    proc = torchrun(run, nproc=1, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"model.path: {tokenizer_without_pad_or_eos}: the tokenizer has neither a pad token" in out, out[-3000:]
    # A model's problem, not the data's: its own exit code, and the run stops with what to change.
    assert f"exit {int(ExitCode.MODEL_ERROR)}: " in out, out[-3000:]
    failed = json.loads((run / "failed").read_text())
    assert failed["exit_code"] == ExitCode.MODEL_ERROR and "[model] or [train]" in failed["fix"], failed
    assert "TypeError" not in out, out[-3000:]
    # Refused in the first seconds: the data was never prepared, so the model was never loaded.
    assert "INFO data: " not in out, out[-3000:]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.torch
@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["zero-bytes", "blank-lines"])
def test_empty_jsonl_is_named_as_empty(tmp_path, content):
    pytest.importorskip("datasets")
    from trainer.data.build import DataError
    from trainer.data.source import load_raw

    path = tmp_path / "train.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=rf"^data\.path: {re.escape(str(path))} is empty \(0 rows\)$"):
        load_raw(str(path), cache_dir=tmp_path / "hf")


@pytest.mark.torch
def test_empty_shards_in_a_data_directory_are_skipped(tmp_path):
    pytest.importorskip("datasets")
    from trainer.data.source import load_raw

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.csv").write_text("instruction,output\nx,y\n")
    (tmp_path / "d" / "b.csv").write_text("")  # datasets' csv builder fails the whole load on this one
    (tmp_path / "d" / "c.csv").write_text("instruction,output\n")
    rows = load_raw(str(tmp_path / "d"), cache_dir=tmp_path / "hf")
    assert len(rows) == 1 and rows.column_names == ["instruction", "output"]


@pytest.mark.torch
def test_data_directory_of_empty_files_is_named_as_empty(tmp_path):
    pytest.importorskip("datasets")
    from trainer.data.build import DataError
    from trainer.data.source import load_raw

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("")
    (tmp_path / "d" / "b.jsonl").write_text("\n\n")
    with pytest.raises(
        DataError,
        match=rf"^data\.path: {re.escape(str(tmp_path / 'd'))} is empty \(0 rows\): "
        r"every data file in it is empty \(a\.jsonl, b\.jsonl\)$",
    ):
        load_raw(str(tmp_path / "d"), cache_dir=tmp_path / "hf")


@pytest.mark.torch
def test_zero_row_dataset_is_named_as_empty_before_its_columns(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    from jobgen.spec.tables.data import DataSpec
    from trainer.data.build import DataError, tokenize_dataset

    # No rows and so no columns: "empty" is the problem, not a missing 'instruction' column.
    with pytest.raises(DataError, match=r"^data\.path: /x/train\.jsonl is empty \(0 rows\)$"):
        tokenize_dataset(
            datasets.Dataset.from_dict({}),
            DataSpec(path="/x/train.jsonl", max_length=64),
            tokenizer,
            source="/x/train.jsonl",
        )


@pytest.mark.torch
def test_chat_set_without_any_assistant_turn_says_so(tokenizer, tmp_path):
    pytest.importorskip("datasets")
    from jobgen.spec.tables.data import DataSpec
    from trainer.data.build import DataError, tokenize_dataset
    from trainer.data.source import load_raw

    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."}]},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "bot", "content": "4"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataSpec(path=str(path), format="chat", max_length=1024)
    with pytest.raises(DataError) as info:
        tokenize_dataset(load_raw(spec.path, cache_dir=tmp_path / "hf"), spec, tokenizer, source=spec.path)
    message = str(info.value)
    assert message.startswith(f'data.path: {path} (data.format = "chat"): no row has an assistant turn'), message
    assert "roles seen: bot, system, user" in message, message
    assert "max_length" not in message, message
