"""trainer.data.build: loading every file type, each format's loss mask, truncation counts, errors."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch
datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

from jobgen.base.paths import EXAMPLES_DIR  # noqa: E402
from jobgen.spec.tables.data import DataSpec  # noqa: E402
from trainer.data.build import DataError, DataStats, tokenize_dataset  # noqa: E402
from trainer.data.encoder import IGNORE_INDEX  # noqa: E402
from trainer.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT  # noqa: E402
from trainer.data.source import load_raw  # noqa: E402

ALPACA_ROWS = [
    {"instruction": "Reverse the word.", "input": "queue", "output": "eueuq"},
    {"instruction": "Add 2 and 3.", "input": "", "output": "2 + 3 = 5."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def encode(tokenizer, rows_or_path, tmp_path: Path, **spec_kwargs):
    if isinstance(rows_or_path, list):
        rows_or_path = write_jsonl(tmp_path / "data.jsonl", rows_or_path)
    spec = DataSpec(path=str(rows_or_path), **spec_kwargs)
    return tokenize_dataset(load_raw(spec.path), spec, tokenizer, source=spec.path)


def target_spans(tokenizer, example) -> list[str]:
    """The decoded runs of consecutive target tokens."""
    spans, run = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label == IGNORE_INDEX:
            if run:
                spans.append(run)
            run = []
        else:
            assert label == token, "a target label must be the token at that position"
            run.append(label)
    if run:
        spans.append(run)
    return [tokenizer.decode(s) for s in spans]


def full_text(tokenizer, example) -> str:
    return tokenizer.decode(example["input_ids"])


# --------------------------------------------------------------------------- formats


def test_alpaca_prompt_and_response_mask(tokenizer, tmp_path):
    ds, stats = encode(tokenizer, ALPACA_ROWS, tmp_path, format="alpaca", max_length=512)
    with_input = ALPACA_PROMPT_WITH_INPUT.format(instruction="Reverse the word.", input="queue")
    without = ALPACA_PROMPT.format(instruction="Add 2 and 3.")
    assert "### Input:" in with_input and "### Input:" not in without
    assert full_text(tokenizer, ds[0]) == "<s>" + with_input + "eueuq</s>"
    assert full_text(tokenizer, ds[1]) == "<s>" + without + "2 + 3 = 5.</s>"
    assert target_spans(tokenizer, ds[0]) == ["eueuq</s>"]
    assert target_spans(tokenizer, ds[1]) == ["2 + 3 = 5.</s>"]
    assert stats == DataStats(
        examples_in=2,
        kept=2,
        truncated=0,
        dropped=0,
        total_tokens=sum(ds["length"]),
        target_tokens=sum(sum(1 for x in ex["labels"] if x != IGNORE_INDEX) for ex in ds),
        longest=max(ds["length"]),
    )
    assert ds["length"] == [len(ex["input_ids"]) for ex in ds]


CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "5"},
]


def test_chat_loss_only_on_assistant_content_and_end_of_turn(tokenizer, tmp_path):
    ds, stats = encode(tokenizer, [{"messages": CONVERSATION}], tmp_path, format="chat", max_length=512)
    ex = ds[0]
    assert full_text(tokenizer, ex) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # Not the "<|im_start|>assistant\n" header, not the newline after <|im_end|>.
    assert target_spans(tokenizer, ex) == ["Hello.<|im_end|>", "5<|im_end|>"]
    assert ex["labels"][0] == IGNORE_INDEX
    assert stats.kept == 1 and stats.dropped == 0


def with_chat_template(tokenizer, template: str | None):
    """A copy of the tokenizer with this chat template (None: none at all)."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def test_chat_falls_back_to_chatml_without_a_template(tokenizer, tmp_path):
    bare = with_chat_template(tokenizer, None)
    ds, _ = encode(bare, [{"messages": CONVERSATION}], tmp_path, format="chat", max_length=512)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert full_text(bare, ds[0]) == expected
    assert target_spans(bare, ds[0]) == ["Hello.<|im_end|>", "5<|im_end|>"]


def test_chat_with_another_template_masks_its_headers(tokenizer, tmp_path):
    other = with_chat_template(
        tokenizer,
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}]: {{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]: {% endif %}",
    )
    ds, _ = encode(other, [{"messages": CONVERSATION}], tmp_path, format="chat", max_length=512)
    assert full_text(other, ds[0]).startswith("<s>[SYSTEM]: Be terse.</s>\n[USER]: Hi</s>\n[ASSISTANT]: Hello.</s>")
    assert target_spans(other, ds[0]) == ["Hello.</s>", "5</s>"]


def test_chat_template_that_rewrites_earlier_turns_is_an_error(tokenizer, tmp_path):
    # Marks the last message specially, so a prefix renders differently inside a longer conversation.
    other = with_chat_template(
        tokenizer,
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}",
    )
    with pytest.raises(DataError, match=r"row 0.*consistently"):
        encode(other, [{"messages": CONVERSATION}], tmp_path, format="chat", max_length=512)


def test_chat_without_assistant_turn_is_dropped_and_counted(tokenizer, tmp_path):
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}]
    ds, stats = encode(tokenizer, rows, tmp_path, format="chat", max_length=512)
    assert (stats.examples_in, stats.kept, stats.dropped, stats.truncated) == (2, 1, 1, 0)
    assert len(ds) == 1


def test_chat_bad_messages_name_the_row(tokenizer, tmp_path):
    rows = [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}]
    with pytest.raises(DataError, match=r"row 1.*message 1 \(assistant\) has no string 'content'"):
        encode(tokenizer, rows, tmp_path, format="chat", max_length=512)


def test_template_format_masks_everything_but_the_response(tokenizer, tmp_path):
    ds, _ = encode(
        tokenizer,
        ALPACA_ROWS,
        tmp_path,
        format="template",
        max_length=512,
        template="### Input: {{input}}\n\n### Label: {{output}}",
    )
    assert full_text(tokenizer, ds[0]) == "<s>### Input: queue\n\n### Label: eueuq</s>"
    assert target_spans(tokenizer, ds[0]) == ["eueuq</s>"]
    assert target_spans(tokenizer, ds[1]) == ["2 + 3 = 5.</s>"]


def test_template_text_after_the_response_is_not_a_target(tokenizer, tmp_path):
    ds, _ = encode(
        tokenizer,
        ALPACA_ROWS[:1],
        tmp_path,
        format="template",
        max_length=512,
        template="Q: {{instruction}} {{input}}\nA: {{output}}\n-- end",
        response_column="output",
    )
    assert full_text(tokenizer, ds[0]) == "<s>Q: Reverse the word. queue\nA: eueuq\n-- end</s>"
    assert target_spans(tokenizer, ds[0]) == ["eueuq", "</s>"]


@pytest.mark.parametrize(
    ("template", "error"),
    [
        pytest.param("{{instruction}} {{output}} {{output}}", "exactly once", id="response-twice"),
        pytest.param("Q: {{question}} A: {{output}}", r"'question'.*'instruction', 'input', 'output'", id="no-column"),
    ],
)
def test_a_template_the_rows_cannot_fill_is_refused(tokenizer, tmp_path, template, error):
    with pytest.raises(DataError, match=error):
        encode(tokenizer, ALPACA_ROWS, tmp_path, format="template", max_length=512, template=template)


def test_text_format_loss_on_everything_but_the_first_token(tokenizer, tmp_path):
    ds, stats = encode(
        tokenizer, [{"body": "The quick brown fox."}], tmp_path, format="text", text_column="body", max_length=512
    )
    ex = ds[0]
    assert full_text(tokenizer, ex) == "<s>The quick brown fox.</s>"
    assert ex["labels"][0] == IGNORE_INDEX
    assert ex["labels"][1:] == ex["input_ids"][1:]
    assert stats.target_tokens == len(ex["input_ids"]) - 1


# --------------------------------------------------------------------------- truncation


def test_truncation_is_counted_and_targetless_examples_dropped(tokenizer, tmp_path):
    rows = [
        {"instruction": "Short.", "input": "", "output": "ok"},  # fits
        {"instruction": "Short.", "input": "", "output": "word " * 200},  # response cut, kept
        {"instruction": "long " * 200, "input": "", "output": "lost"},  # prompt alone too long: dropped
    ]
    # Room for the short prompt (with bos) and 20 response tokens.
    limit = len(tokenizer(ALPACA_PROMPT.format(instruction="Short."))["input_ids"]) + 20
    ds, stats = encode(tokenizer, rows, tmp_path, format="alpaca", max_length=limit)
    assert (stats.examples_in, stats.kept, stats.truncated, stats.dropped) == (3, 2, 2, 1)
    assert stats.longest > limit
    assert max(ds["length"]) == limit
    assert all(len(ex["input_ids"]) == len(ex["labels"]) <= limit for ex in ds)
    assert stats.total_tokens == sum(ds["length"])
    assert stats.target_tokens == sum(sum(1 for x in ex["labels"] if x != IGNORE_INDEX) for ex in ds)
    cut = ds[1]
    assert cut["input_ids"][-1] != tokenizer.eos_token_id  # the head is kept, eos was cut off
    assert target_spans(tokenizer, cut)[0].startswith("word word")


def test_stats_are_json_serialisable(tokenizer, tmp_path):
    _, stats = encode(tokenizer, ALPACA_ROWS, tmp_path, format="alpaca", max_length=512)
    assert DataStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats
    assert "2/2 examples kept" in stats.summary()


# --------------------------------------------------------------------------- file types


def _alpaca_files(tmp_path: Path) -> dict[str, Path]:
    import pandas as pd

    frame = pd.DataFrame(ALPACA_ROWS)
    files = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", ALPACA_ROWS),
        "json": tmp_path / "d.json",
        "csv": tmp_path / "d.csv",
        "parquet": tmp_path / "d.parquet",
        "saved": tmp_path / "saved",
        "saved_dict": tmp_path / "saved_dict",
        "dir": tmp_path / "shards",
    }
    files["json"].write_text(json.dumps(ALPACA_ROWS))
    frame.to_csv(files["csv"], index=False)  # the empty input becomes a CSV null
    frame.to_parquet(files["parquet"])
    datasets.Dataset.from_list(ALPACA_ROWS).save_to_disk(str(files["saved"]))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA_ROWS)}).save_to_disk(str(files["saved_dict"]))
    files["dir"].mkdir()
    write_jsonl(files["dir"] / "part-0.jsonl", ALPACA_ROWS[:1])
    write_jsonl(files["dir"] / "part-1.jsonl", ALPACA_ROWS[1:])
    return files


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "saved", "saved_dict", "dir"])
def test_every_file_type_gives_the_same_examples(tokenizer, tmp_path, kind):
    files = _alpaca_files(tmp_path)
    raw = load_raw(str(files[kind]), cache_dir=tmp_path / "hf")
    assert len(raw) == 2
    ds, _ = encode(tokenizer, files[kind], tmp_path, format="alpaca", max_length=512)
    reference, _ = encode(tokenizer, files["jsonl"], tmp_path, format="alpaca", max_length=512)
    assert ds["input_ids"] == reference["input_ids"]
    assert ds["labels"] == reference["labels"]


def test_example_data_loads_in_both_formats(tokenizer):
    for name, fmt in (("instructions.jsonl", "alpaca"), ("chat.jsonl", "chat")):
        path = EXAMPLES_DIR / "data" / name
        _, stats = encode(tokenizer, path, Path("/nonexistent"), format=fmt, max_length=512)
        assert stats.kept == stats.examples_in > 50 and stats.dropped == 0


# --------------------------------------------------------------------------- errors


def test_missing_path_is_named(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path / "nope.jsonl")):
        load_raw(str(tmp_path / "nope.jsonl"))


def test_unsupported_suffix_is_named(tmp_path):
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match=r"d\.txt: unsupported type '\.txt'"):
        load_raw(str(tmp_path / "d.txt"))


def test_directory_with_mixed_types_is_an_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS)
    (tmp_path / "b.csv").write_text("instruction,output\nx,y\n")
    with pytest.raises(DataError, match="mixes file types"):
        load_raw(str(tmp_path))


def test_hub_id_offline_fails_naming_the_id(monkeypatch):
    # datasets reads HF_DATASETS_OFFLINE once, at import; the environment alone may come too late.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="'someorg/not-a-dataset'"):
        load_raw("someorg/not-a-dataset")


def test_missing_column_names_column_and_path(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "output": "y"}])
    with pytest.raises(DataError, match=rf"{path}: format 'alpaca' needs column\(s\) 'instruction'.*'prompt'"):
        encode(tokenizer, path, tmp_path, format="alpaca", max_length=64)


def test_bad_row_is_named_by_index(tokenizer, tmp_path):
    rows = [*ALPACA_ROWS, {"instruction": "x", "input": "", "output": None}]
    with pytest.raises(DataError, match=r"row 2: column 'output' is missing \(null\)"):
        encode(tokenizer, rows, tmp_path, format="alpaca", max_length=64)


def test_no_rows_or_no_targets_at_all_is_an_error(tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"^data\.path: empty is empty \(0 rows\)$"):
        tokenize_dataset(
            datasets.Dataset.from_dict({"instruction": [], "output": []}),
            DataSpec(path="empty", max_length=64),
            tokenizer,
            source="empty",
        )
    with pytest.raises(DataError, match=r"no example has a target token within max_length=16.*0/2 examples kept"):
        encode(tokenizer, ALPACA_ROWS, tmp_path, format="alpaca", max_length=16)


# ---------------------------------------------------------------- tokenizing with several processes


def _rows(n: int) -> list[dict]:
    return [
        {"instruction": f"Say {i} twice.", "input": "" if i % 3 else f"n={i}", "output": f"{i} {i}" + " ok" * (i % 7)}
        for i in range(n)
    ]


def test_several_tokenizing_processes_give_the_same_files_byte_for_byte(tokenizer, tmp_path, monkeypatch):
    import trainer.data.build as build_module

    monkeypatch.setattr(build_module, "SHARD_ROWS", 1000)  # 3 shards, the last a short one
    rows = _rows(2500)
    spec = DataSpec(path=str(write_jsonl(tmp_path / "data.jsonl", rows)), max_length=512)
    one, one_stats = tokenize_dataset(load_raw(spec.path), spec, tokenizer, source=spec.path, work_dir=tmp_path / "a")
    two, two_stats = tokenize_dataset(
        load_raw(spec.path), spec, tokenizer, source=spec.path, work_dir=tmp_path / "b", num_proc=2
    )
    assert len(one) == len(rows) and one_stats == two_stats
    assert one.to_dict() == two.to_dict()
    files = sorted(p.name for p in (tmp_path / "a" / "dataset").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b" / "dataset").iterdir())
    assert [f for f in files if f.endswith(".arrow")] == [f"data-0000{k}-of-00003.arrow" for k in range(3)]
    for name in files:
        assert (tmp_path / "a" / "dataset" / name).read_bytes() == (tmp_path / "b" / "dataset" / name).read_bytes()


def test_a_bad_row_in_a_worker_is_the_same_data_error(tokenizer, tmp_path, monkeypatch):
    import trainer.data.build as build_module
    from trainer.data.build import DataError

    monkeypatch.setattr(build_module, "SHARD_ROWS", 1000)
    rows = _rows(2500)
    rows[2100]["output"] = 7  # in the second worker's shard
    spec = DataSpec(path=str(write_jsonl(tmp_path / "data.jsonl", rows)), max_length=512)
    with pytest.raises(DataError) as one:
        tokenize_dataset(load_raw(spec.path), spec, tokenizer, source=spec.path, work_dir=tmp_path / "a")
    with pytest.raises(DataError) as two:
        tokenize_dataset(load_raw(spec.path), spec, tokenizer, source=spec.path, work_dir=tmp_path / "b", num_proc=2)
    assert str(two.value) == str(one.value) and "row 2100" in str(two.value), str(two.value)


def test_the_number_of_tokenizing_processes():
    from trainer.data.build import (
        AUTO_ROWS_PER_PROCESS,
        MIN_SHARD_ROWS,
        SHARD_ROWS,
        TARGET_SHARDS,
        shard_rows,
        tokenizer_processes,
    )

    # Unset: the job's CPUs, one per AUTO_ROWS_PER_PROCESS rows at most, at least one.
    assert tokenizer_processes(1_000_000, None, cpus=16) == 16
    assert tokenizer_processes(3 * AUTO_ROWS_PER_PROCESS, None, cpus=16) == 3
    assert tokenizer_processes(500, None, cpus=16) == 1
    # Asked for: as many, but never more than one per shard of rows.
    assert tokenizer_processes(1_000_000, 4, cpus=16) == 4
    assert tokenizer_processes(2500, 8, cpus=16) == 3  # shards of MIN_SHARD_ROWS
    assert tokenizer_processes(10, 8, cpus=16) == 1
    assert shard_rows(10) == MIN_SHARD_ROWS and shard_rows(10**9) == SHARD_ROWS
    assert shard_rows(TARGET_SHARDS * 5000) == 5000
    import os

    assert tokenizer_processes(10**9, None) == len(os.sched_getaffinity(0))


def test_a_long_tokenization_says_how_far_it_got(tokenizer, tmp_path, monkeypatch, caplog):
    """Every PROGRESS_LOG_SECONDS the preparation logs rows, rate and ETA."""
    import logging

    import trainer.data.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "PROGRESS_LOG_SECONDS", 0.0)
    monkeypatch.setattr(prepare_module, "BATCH_ROWS", 2)
    with caplog.at_level(logging.INFO, logger="trainer.data.prepare"):
        encode(tokenizer, ALPACA_ROWS * 4, tmp_path, format="alpaca", max_length=512)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizing ")]
    lines = [line for line in lines if " rows/s, " in line]
    rows = len(ALPACA_ROWS) * 4
    assert lines and f": {rows:,}/{rows:,} rows (100%), " in lines[-1] and "ETA 0s" in lines[-1]
    assert all(" rows/s, ETA " in line for line in lines), lines


def test_a_nodes_progress_counts_every_nodes_shards_and_stops_once_they_were_removed(tmp_path, monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    import trainer.data.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "PROGRESS_LOG_SECONDS", 0.0)
    done = tmp_path / "done"
    done.mkdir()
    for k in (0, 1, 5):  # shards finished, by this node or another
        (done / f"shard-{k}.json").write_text("{}")
    (done / ".tmp-shard-7.json").write_text("")  # a write in flight is no shard done
    progress = prepare_module.Progress(1000, "rows.jsonl (alpaca)", SimpleNamespace(done_dir=str(done), shards=64))
    with caplog.at_level(logging.INFO, logger="trainer.data.prepare"):
        progress.update(500)
    assert "500/1,000 rows (50%)" in caplog.text and "; all nodes: 3 of 64 shards done" in caplog.text, caplog.text
    # A node that met bad data removed the shard directory: this node stops at its next line.
    pinned = os.open(done, os.O_RDONLY | os.O_DIRECTORY)
    try:
        shutil.rmtree(done)
        progress.work = SimpleNamespace(done_dir=f"/proc/self/fd/{pinned}", shards=64)
        with pytest.raises(prepare_module.PreparationAbandoned, match="shard directory was removed"):
            progress.update(600)
    finally:
        os.close(pinned)
