"""docs/architecture.md's layout is generated from the rooms' and modules' docstrings
(jobgen/cli/architecture.py) and must match the code: a module added, moved or removed without
regenerating it fails here, as docs/reference/ does in test_reference_docs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import jobgen
from helpers import REPO
from jobgen.cli.architecture import BEGIN, END, LayoutError, layout, replaced

DOC = REPO / "docs" / "architecture.md"


def test_the_layout_in_docs_is_the_generated_one():
    text = DOC.read_text()
    assert text[text.index(BEGIN) : text.index(END) + len(END)] == layout(), (
        "docs/architecture.md is stale: python -m jobgen.cli.architecture --write docs/architecture.md"
    )


def test_every_module_has_its_row():
    text = DOC.read_text()
    # jobgen/bundled/ is the package's data (templates, profiles, the examples a user copies), not its code.
    code = [
        p for pkg in ("jobgen", "trainer", "watchdogs") for p in (REPO / pkg).rglob("*.py") if "bundled" not in p.parts
    ]
    missing = [
        p.relative_to(REPO).as_posix()
        for p in code
        if p.name != "__init__.py"
        and "__pycache__" not in p.parts
        and f"`{p.relative_to(REPO).as_posix()}`" not in text
    ]
    # jobgen/runtime and jobgen/devcluster are rooms too, listed like the others.
    assert not missing, f"modules without a row in docs/architecture.md: {missing}"
    for room in jobgen.ROOMS:
        assert f"### `jobgen/{room}/`" in text, room


def test_a_new_module_shows_in_the_layout(tmp_path: Path):
    for room in jobgen.ROOMS:
        (tmp_path / "jobgen" / room).mkdir(parents=True)
        (tmp_path / "jobgen" / room / "__init__.py").write_text(f'"""The {room} room."""\n')
    for pkg in ("trainer", "watchdogs"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text('"""A package."""\n')
    (tmp_path / "jobgen" / "plan" / "fresh.py").write_text('"""A fresh estimate. More words."""\n')
    generated = layout(tmp_path)
    assert "| `jobgen/plan/fresh.py` | A fresh estimate. |" in generated
    assert "May import: `base`, `model`, `spec`." in generated


def test_a_document_without_the_markers_is_refused():
    with pytest.raises(LayoutError):
        replaced("# no layout here\n", layout())
