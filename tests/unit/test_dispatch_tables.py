"""Every program and every parallelism is one table entry (issue 31): what a program kind or a
parallelism means is said by its entry and read from it, never by a branch on its name
somewhere else. The tables: jobgen/program/kinds.py (``job.program``), jobgen/model/parallelism.py
(``train.parallelism``, what jobgen checks and plans) and trainer/parallel/strategies.py (how
the trainer runs each one, keyed by the same names).

A branch on a name is, anywhere in jobgen/ or trainer/ outside those modules and the pydantic
``Literal`` declarations: a comparison or membership test against a name literal
(``program == "command"``, ``parallelism in ("ddp", "fsdp")``), a ``case "pipeline":``, a dict
literal keyed by names only (a table of its own), and a lookup of one named entry in a
module's table (``STRATEGIES["hsdp"]``). Every module is parsed, not imported."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO
from jobgen.model.parallelism import STRATEGIES
from jobgen.program.kinds import PROGRAMS

PACKAGES = ("jobgen", "trainer")
TABLES = {"jobgen/program/kinds.py", "jobgen/model/parallelism.py", "trainer/parallel/strategies.py"}
# The same word meaning something else, by module: no program or parallelism is meant there.
OTHER_MEANINGS = {
    ("trainer/data/source.py", "train"): "a dataset's split",
    ("trainer/tracking.py", "train"): "the trackers' section of the training metrics",
}


def names() -> set[str]:
    return set(PROGRAMS) | set(STRATEGIES)


def _named(node: ast.AST, words: set[str]) -> list[str]:
    """The names ``node`` holds: a name literal, or a tuple, list or set of literals with names."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value in words]


def _is_table(node: ast.AST) -> bool:
    """A module-level table by its name (``STRATEGIES``, ``PLANS``): upper case."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.isupper()


def _branch_names(node: ast.AST, words: set[str]) -> list[str]:
    if isinstance(node, ast.Compare):
        return [name for operand in (node.left, *node.comparators) for name in _named(operand, words)]
    if isinstance(node, ast.match_case):
        values = [p.value for p in ast.walk(node.pattern) if isinstance(p, ast.MatchValue)]
        return [name for value in values for name in _named(value, words)]
    if isinstance(node, ast.Dict) and node.keys and all(k is not None and _named(k, words) for k in node.keys):
        return [name for k in node.keys if k is not None for name in _named(k, words)]
    if isinstance(node, ast.Subscript) and _is_table(node.value):
        return _named(node.slice, words)
    return []


def branches(root: Path, words: set[str]) -> list[tuple[str, int, str]]:
    """(module, line, source) of every branch on one of ``words`` outside the tables."""
    found = []
    for path in sorted(p for package in PACKAGES for p in (root / package).rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module in TABLES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            hits = [n for n in _branch_names(node, words) if (module, n) not in OTHER_MEANINGS]
            if hits:
                where = node.pattern if isinstance(node, ast.match_case) else node
                found.append((module, where.lineno, ast.unparse(where).splitlines()[0][:100]))
    return found


def test_no_branch_on_a_program_or_parallelism_name_outside_the_tables():
    found = branches(REPO, names())
    assert not found, "branches on a name; read the table's entry instead:\n" + "\n".join(
        f"  {module}:{line}: {text}" for module, line, text in found
    )


def test_the_finder_sees_every_kind_of_branch(tmp_path: Path):
    source = "\n".join(
        [
            "from typing import Literal",
            "Kind = Literal['train', 'doctor']",  # a declaration, not a branch
            "def f(spec, inputs, x):",
            "    if spec.run.job.program == 'command': pass",  # 4
            "    if inputs.parallelism in ('ddp', 'fsdp'): pass",  # 5
            "    match x:",
            "        case 'pipeline': pass",  # 7
            "    TABLE = {'train': 1, 'doctor': 2}",  # 8
            "    record = {'pipeline': None, 'steps': 3}",  # a record with such a key: no table
            "    entry = STRATEGIES['hsdp']",  # 10
            "    value = record['pipeline']",  # a record's field
            "    return 'ddp' if x else 'fsdp'",  # a value, not a branch
        ]
    )
    (tmp_path / "jobgen").mkdir()
    (tmp_path / "jobgen" / "m.py").write_text(source)
    (tmp_path / "trainer").mkdir()
    assert [line for _, line, _ in branches(tmp_path, names())] == [4, 5, 7, 8, 10]
