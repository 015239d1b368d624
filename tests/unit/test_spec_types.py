"""Every value of run.toml and of a site profile has the type its key says, and every refusal
reads as a sentence (issue 30, item 12): ``nodes = true`` is no 1, and a path with a space is
told which character it cannot hold, never shown a regular expression."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from helpers import DATA, jobgen, run_spec, spec_issues
from jobgen.spec.fields import SpecModel
from jobgen.spec.loader import SpecError, load_run
from jobgen.spec.tables.run import RunSpec
from jobgen.spec.tables.site import SiteProfile


def _types(annotation: Any) -> Iterator[Any]:
    """Every type an annotation is made of (unions, lists, dicts, Annotated unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        yield from _types(typing.get_args(annotation)[0])
    elif origin is not None:
        yield origin
        for arg in typing.get_args(annotation):
            yield from _types(arg)
    else:
        yield annotation


def spec_models(root: type[BaseModel], seen: set[type] | None = None) -> Iterator[type[SpecModel]]:
    """The tables of run.toml and of a site profile below ``root`` that are SpecModels."""
    seen = set() if seen is None else seen
    if root in seen:
        return
    seen.add(root)
    if issubclass(root, SpecModel):
        yield root
    for info in root.model_fields.values():
        for kind in _types(info.annotation):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                yield from spec_models(kind, seen)


def number_fields() -> list[tuple[type[BaseModel], str, Any]]:
    """(table, key, a bool where a number belongs) for every int and float key of the tables."""
    found = []
    for model in {*spec_models(RunSpec), *spec_models(SiteProfile)}:
        for name, info in model.model_fields.items():
            kinds = list(_types(info.annotation))
            if int in kinds or float in kinds:
                found.append((model, name, [True] if list in kinds else True))
    return sorted(found, key=lambda f: (f[0].__name__, f[1]))


def test_the_walk_reaches_every_table():
    names = {m.__name__ for m in [*spec_models(RunSpec), *spec_models(SiteProfile)]}
    expected = {
        "RunSpec",
        "JobSpec",
        "ModelSpec",
        "LoraSpec",
        "DataSpec",
        "DataSourceSpec",
        "TrainSpec",
        "PipelineSpec",
        "EvalSpec",
    }
    expected |= {
        "CommandSpec",
        "SiteProfile",
        "SlurmSettings",
        "NetworkSettings",
        "PathSettings",
        "PythonSettings",
        "NodeShape",
    }
    expected |= {"ServeSpec", "SweepSpec", "WatchdogSettings", "DiskCheck", "RunningCheck", "HangCheck", "MemoryCheck"}
    expected |= {"EmailSettings", "WebhookSettings"}
    assert names == expected
    assert len(number_fields()) > 30


@pytest.mark.parametrize("model, key, value", number_fields(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_no_number_key_takes_a_bool(model: type[BaseModel], key: str, value: Any):
    with pytest.raises(Exception) as info:
        model.model_validate({key: value})
    assert any(error["loc"][:1] == (key,) for error in info.value.errors()), info.value


@pytest.mark.parametrize(
    "table, key, value",
    [
        ("job", "nodes", True),
        ("job", "array", True),
        ("job", "min_nodes", True),
        ("job", "nodes", "2"),
        ("train", "micro_batch_size", True),
        ("train", "max_steps", 1000.0),
        ("train", "lr", True),
        ("data", "max_length", "512"),
    ],
)
def test_a_value_of_another_type_is_refused_in_run_toml(tmp_path: Path, table: str, key: str, value: Any):
    tables = {"job": {"time": "1h"}, "model": {"path": "org/m"}, "data": {"path": str(DATA)}}
    tables[table] = {**tables.get(table, {}), key: value}
    found = spec_issues(run_spec(tmp_path, "t", **tables))
    assert f"{table}.{key}" in found, found


def test_pipeline_block_counts_are_whole_numbers(tmp_path: Path):
    train = {"parallelism": "pipeline", "pipeline": {"layers_per_stage": [True, 1]}}
    found = spec_issues(
        run_spec(tmp_path, "t", job={"time": "1h"}, model={"path": "o/m"}, data={"path": "o/d"}, train=train)
    )
    assert "train.pipeline.layers_per_stage[0]" in found, found


# ---------------------------------------------------------------- pattern-constrained keys


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def pattern_keys(schema: dict[str, Any], defs: dict[str, Any], path: tuple = ()) -> Iterator[tuple]:
    """The path of every value the schema constrains with a pattern: key names, "[]" for a list's
    entries, "{name}" for a table's own names."""
    schema = _resolve(schema, defs)
    if "pattern" in schema:
        yield path
    for option in schema.get("anyOf", []):
        yield from pattern_keys(option, defs, path)
    for key, sub in schema.get("properties", {}).items():
        yield from pattern_keys(sub, defs, (*path, key))
    if isinstance(schema.get("items"), dict):
        yield from pattern_keys(schema["items"], defs, (*path, "[]"))
    if schema.get("patternProperties"):  # a table whose own names must match
        yield (*path, "{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from pattern_keys(schema["additionalProperties"], defs, (*path, "{value}"))


def all_pattern_keys() -> list[tuple]:
    keys = []
    for prefix, model in (((), RunSpec), (("site",), SiteProfile)):
        schema = model.model_json_schema()
        keys += [(*prefix, *path) for path in pattern_keys(schema, schema.get("$defs", {}))]
    return sorted(set(keys))


def _place(path: tuple, value: str) -> Any:
    """``value`` at ``path`` inside a document of nested tables."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if head == "[]":
        return [_place(rest, value)]
    if head == "{name}":
        return {value: "x"}
    if head == "{value}":
        return {"NAME": _place(rest, value)}
    return {head: _place(rest, value)}


def _merge(into: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    for key, value in new.items():
        into[key] = _merge(into.get(key, {}), value) if isinstance(value, dict) and key in into else value
    return into


def test_the_walk_finds_the_pattern_keys():
    keys = {".".join(k) for k in all_pattern_keys()}
    assert {"job.name", "job.runs_root", "job.exclude.[]", "env.{name}", "site.slurm.mem"} <= keys
    assert {"command.module", "site.python.container_image", "site.network.ifname", "site.name"} <= keys


@pytest.mark.parametrize("path", all_pattern_keys(), ids=".".join)
def test_every_pattern_key_says_in_words_what_is_wrong(tmp_path: Path, path: tuple):
    bad = "my dir"
    doc = _merge({"job": {"name": "t", "time": "1h"}, "site": {"profile": "local"}}, _place(path, bad))
    spec = tmp_path / "run.toml"
    spec.write_text(_toml(doc))
    with pytest.raises(SpecError) as info:
        load_run(spec)
    messages = [issue.message for issue in info.value.issues]
    assert any(f"'{bad}' is not " in m for m in messages), messages  # what the value is not, in words
    for message in messages:
        assert "should match" not in message and "[A-Za-z" not in message, message  # no regular expression


def _toml(doc: dict[str, Any]) -> str:
    """Nested tables as TOML: [a] for a table of plain values, dotted keys inside it."""
    lines = []
    plain = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    lines += [f"{k} = {json.dumps(v)}" for k, v in plain.items()]
    for table, keys in doc.items():
        if isinstance(keys, dict):
            lines.append(f"[{table}]")
            lines += [f"{_dotted(k)} = {_inline(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def _dotted(key: str) -> str:
    return key if key.replace("_", "").isalnum() else json.dumps(key)


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_dotted(k)} = {_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return json.dumps(value)


# ---------------------------------------------------------------- files that are no files


@pytest.mark.parametrize("key", ["eval.prompts_file", "data.path", "eval.path"])
def test_a_fifo_is_refused_in_one_line_without_reading_it(tmp_path: Path, key: str):
    import os

    fifo = tmp_path / ("prompts.jsonl" if key == "eval.prompts_file" else "rows.jsonl")
    os.mkfifo(fifo)  # nobody writes to it: opening it for reading would wait forever
    (tmp_path / "train.jsonl").write_text('{"instruction": "x", "output": "y"}\n')
    table, name = key.split(".")
    tables = {"data": {"path": "train.jsonl"}, "eval": {"split": 0.1}}
    tables[table] = {**tables[table], name: fifo.name}
    if key == "eval.path":
        tables["eval"].pop("split")
    spec = run_spec(tmp_path, "t", job={"time": "1h"}, model={"path": "org/m"}, **tables)
    proc = jobgen("validate", str(spec), timeout=60)  # it used to hang here
    assert proc.returncode != 0
    assert f"{spec}: {key}: {fifo} is a FIFO, not a regular file or directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_directory_as_the_prompts_file_is_refused(tmp_path: Path):
    (tmp_path / "prompts").mkdir()
    tables = {"data": {"path": str(DATA)}, "eval": {"split": 0.1, "prompts_file": "prompts"}}
    found = spec_issues(run_spec(tmp_path, "t", job={"time": "1h"}, model={"path": "org/m"}, **tables))
    assert "is a directory: give a file of prompts" in found.get("eval.prompts_file", ""), found
