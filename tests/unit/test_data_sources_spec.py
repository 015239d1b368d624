"""``[[data.sources]]`` in run.toml: each source read its own way and named, checked by the loader
as data.path is (a missing file named by its key, paths made absolute), refused where it cannot
be honoured (path and sources, a source with both or neither weight and epochs, two sources of
one name, eval.path beside a mixture); status shows the tokens drawn per source."""

from __future__ import annotations

import pytest

from helpers import DATA, run_spec, spec_issues
from jobgen.report.status import RunStatus, _source_tokens
from jobgen.report.status_format import format_status
from jobgen.spec.loader import load_run


def spec(tmp_path, data, **tables):
    return run_spec(
        tmp_path,
        "mix",
        job={"time": "1h"},
        model={"path": str(tmp_path)},
        data=data,
        train={"max_steps": 10},
        **tables,
    )


def test_each_source_is_read_its_own_way_with_the_mixtures_length(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text('{"messages": []}\n')
    sources = [
        {"path": str(DATA), "weight": 2.0},
        {"path": "data/chat.jsonl", "format": "chat", "epochs": 1.5, "name": "dialog"},
    ]
    run = load_run(spec(tmp_path, {"sources": sources, "max_length": 64, "packing": True})).run
    (first, second) = run.data.source_specs()
    assert first[:2] == ("data.sources[0]", "instructions") and first[2].format == "alpaca"
    assert second[:2] == ("data.sources[1]", "dialog") and second[2].format == "chat"
    assert second[2].path == str(tmp_path / "data" / "chat.jsonl")  # relative to run.toml, made absolute
    assert (second[2].max_length, second[2].packing, second[2].sources) == (64, True, None)
    assert run.data.paths()[1] == ("data.sources[1].path", str(tmp_path / "data" / "chat.jsonl"))
    assert run.data.describe_sources() == "data.sources: instructions (alpaca, weight 2), dialog (chat, 1.5 epochs)"


def test_one_path_is_the_one_source(tmp_path):
    run = load_run(spec(tmp_path, {"path": str(DATA)})).run
    assert [(prefix, name) for prefix, name, _ in run.data.source_specs()] == [("data", "instructions")]


@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        ({"sources": [{"path": "nowhere.jsonl", "weight": 1.0}]}, "data.sources[0].path", "does not exist"),
        ({"path": str(DATA), "sources": [{"path": str(DATA), "weight": 1.0}]}, "data", "not both or neither"),
        ({"sources": [{"path": str(DATA)}]}, "data.sources[0]", "either a weight"),
        ({"sources": [{"path": str(DATA), "weight": 1.0, "epochs": 2.0}]}, "data.sources[0]", "either a weight"),
        ({"sources": [{"path": str(DATA), "weight": 0.0}]}, "data.sources[0].weight", "greater than 0"),
        ({"sources": [{"path": str(DATA), "weight": 1.0}] * 2}, "data", "instructions are given twice"),
        ({"sources": [{"path": str(DATA), "weight": 1.0, "name": "a b"}]}, "data.sources[0]", "name 'a b'"),
        ({"sources": [{"path": str(DATA), "weight": 1.0, "format": "template"}]}, "data.sources[0].template", "needs"),
        ({"sources": []}, "data.sources", "at least 1"),
        ({"format": "chat", "sources": [{"path": str(DATA), "weight": 1.0}]}, "data", "data.format is set beside"),
    ],
)
def test_a_mixture_that_cannot_be_honoured_is_named_by_its_key(tmp_path, data, key, words):
    issues = spec_issues(spec(tmp_path, data))
    assert key in issues and words in issues[key], issues


def test_eval_path_beside_a_mixture_is_refused_for_eval_split(tmp_path):
    data = {"sources": [{"path": str(DATA), "weight": 1.0}]}
    issues = spec_issues(spec(tmp_path, data, eval={"path": str(DATA)}))
    (message,) = issues.values()
    assert "eval.split" in message and "each source holds out that share" in message, issues


def test_status_shows_each_sources_share_of_the_tokens_drawn():
    status = RunStatus(run_dir="/r", name="r", program="train", state="running", step=3, max_steps=9)
    status.source_tokens = {"math": 500, "prose": 300, "dialog": 200}
    assert "data     math 50.0%, prose 30.0%, dialog 20.0% of 1,000 tokens drawn" in format_status(status)
    assert status.to_json()["source_tokens"] == {"math": 500, "prose": 300, "dialog": 200}
    # A metrics line is input: anything but a table of counts is left out.
    for damaged in ({"a": -1}, {"a": True}, {"a": 1.5}, ["a"], {}, None, {"a": "1"}):
        assert _source_tokens(damaged) is None, damaged


def test_validate_lists_the_mixture(tmp_path):
    from helpers import jobgen

    sources = [{"path": str(DATA), "weight": 3.0}, {"path": str(DATA), "name": "again", "epochs": 2.0}]
    proc = jobgen("validate", str(spec(tmp_path, {"sources": sources})))
    assert proc.returncode == 0, proc.stderr
    assert "data.sources: instructions (alpaca, weight 3), again (alpaca, 2 epochs)" in proc.stdout, proc.stdout


def test_a_mixture_reads_back_from_spec_json_as_it_was_written(tmp_path):
    # spec.json holds every key, defaults included: the mixture must still validate (this failed
    # when a [data] key beside the sources was told from model_fields_set).
    from jobgen.spec.tables.data import DataSpec

    data = load_run(spec(tmp_path, {"sources": [{"path": str(DATA), "weight": 1.0}]})).run.data
    assert DataSpec.model_validate_json(data.model_dump_json()) == data
