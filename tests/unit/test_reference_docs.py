"""The documentation stays true to the code: docs/reference/*.md are what `jobgen schema
--markdown` prints today, and every TOML example in README.md and docs/ validates."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib

from helpers import REPO
from jobgen.spec.loader import SpecError, resolve
from jobgen.spec.reference import RUN_COMMAND, SITE_COMMAND, run_markdown, site_markdown
from jobgen.spec.tables.site import SiteProfile
from jobgen.sweep.points import expand, is_sweep

REFERENCES = [
    ("docs/reference/run-toml.md", run_markdown, RUN_COMMAND),
    ("docs/reference/site.md", site_markdown, SITE_COMMAND),
]


@pytest.mark.parametrize(("path", "generate", "command"), REFERENCES, ids=[r[0] for r in REFERENCES])
def test_reference_is_up_to_date(path, generate, command):
    committed = REPO / path
    assert committed.is_file(), f"{path} is missing; generate it with `.venv/bin/{command}`"
    assert committed.read_text() == generate(), (
        f"{path} is stale (a model in jobgen/ changed); regenerate it with `.venv/bin/{command}`"
    )


def test_cli_prints_the_reference():
    from click.testing import CliRunner

    from jobgen.cli.main import main

    cases = ((["schema", "--markdown"], run_markdown), (["schema", "--site", "--markdown"], site_markdown))
    for args, generate in cases:
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert result.output == generate()


def test_reference_is_deterministic_and_covers_every_table():
    text = run_markdown()
    assert text == run_markdown()
    for table in ("job", "model", "model.lora", "data", "train", "eval", "serve", "command", "env", "watchdogs"):
        assert f"[{table}]\n" in text, table
    assert '| `time` | duration like "30m" | required |' in text
    assert '| `program` | one of "train" / "doctor" / "command" | `"train"` |' in text
    site = site_markdown()
    for table in ("slurm", "network", "paths", "python", "env", "watchdogs", "watchdogs.email"):
        assert f"## [{table}]\n" in site or f"### [{table}]\n" in site, table
    kinds = '"auto" / "venv" / "conda" / "prefix" / "modules" / "container" / "none"'
    assert f'| `kind` | one of {kinds} | `"auto"` |' in site  # the profile's default


# ---- TOML examples in the documentation ------------------------------------------------------------

_FENCE = re.compile(r"^```toml\n(.*?)^```", re.MULTILINE | re.DOTALL)

# Snippets known not to validate, by file and a line of theirs, with the reason. README.md is
# edited by others; a fixed snippet turns its entry into an XPASS failure: delete the entry then.
KNOWN_BAD: dict[tuple[str, str], str] = {}


def _snippets() -> list[Any]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    params = []
    for path in files:
        text = path.read_text()
        rel = str(path.relative_to(REPO))
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            body = match.group(1)
            bad = [why for (file, line_text), why in KNOWN_BAD.items() if file == rel and line_text in body]
            marks = [pytest.mark.xfail(reason=why, strict=True) for why in bad]
            params.append(pytest.param(body, id=f"{rel}:{line}", marks=marks))
    return params


def _wrap(doc: dict[str, Any]) -> dict[str, Any]:
    """A fragment (a table or two, e.g. just [eval]) made into a minimal run.toml: keys the
    snippet sets win; a whole example already has every key this adds."""
    doc = copy.deepcopy(doc)
    doc.setdefault("site", "local")
    job = doc.setdefault("job", {})
    job.setdefault("name", "snippet")
    job.setdefault("time", "1h")
    if job.get("program", "train") == "train":
        doc.setdefault("model", {}).setdefault("path", "models/stub")
        data = doc.setdefault("data", {})
        if "sources" not in data:  # a mixture names its files in [[data.sources]]
            data.setdefault("path", "data/stub.jsonl")
    return doc


_ROW = {"instruction": "hi", "input": "", "output": "hello", "text": "hello", "messages": []}


def _stub_files(doc: dict[str, Any], root: Path) -> None:
    """The relative files a snippet names, stubbed under root: directories for the model and the
    command's workdir, a one-row JSONL file for data, a file for everything else. Hub ids
    ('org/name') become directories too, which the loader accepts just the same."""
    wanted = [
        (doc.get("model", {}).get("path"), "dir"),
        (doc.get("data", {}).get("path"), "rows"),
        *((source.get("path"), "rows") for source in doc.get("data", {}).get("sources", [])),
        (doc.get("eval", {}).get("path"), "rows"),
        (doc.get("eval", {}).get("prompts_file"), "file"),
        (doc.get("command", {}).get("script"), "file"),
        (doc.get("command", {}).get("workdir"), "dir"),
    ]
    for value, kind in wanted:
        if not isinstance(value, str) or value.startswith(("/", "~")):
            continue
        path = root / value
        if kind == "dir":
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_ROW) + "\n" if kind == "rows" else "print('stub')\n")


@pytest.mark.parametrize("snippet", _snippets())
def test_toml_snippet_validates(snippet, tmp_path):
    if snippet.startswith("# a site profile"):  # a part of a site profile, not of a run.toml
        SiteProfile.model_validate({"name": "snippet", **tomllib.loads(snippet)})
        return
    doc = _wrap(tomllib.loads(snippet))
    _stub_files(doc, tmp_path)
    try:
        if is_sweep(doc):  # every point, each a full spec
            expand(doc, tmp_path / "run.toml")
        else:
            resolve(doc, spec_file=tmp_path / "run.toml", base_dir=tmp_path)
    except SpecError as exc:
        pytest.fail("the snippet does not validate:\n" + "\n".join(map(str, exc.issues)))
