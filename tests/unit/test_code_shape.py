"""The shape the code keeps so that a newcomer can read it: no function of the packages over
60 lines (decorators and docstring included) and no module over 500. ruff's PLR0915
(pyproject.toml) bounds the statements in a function as well; this bounds what a reader
scrolls through. A function that grows past the bound is split into named steps (gather,
then decide), not given an exemption."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGES = ("jobgen", "trainer", "watchdogs")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def long_functions(source: str, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function or method longer than ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > limit:
                found.append((node.name, first, length))
    return found


def test_the_counter_sees_methods_nested_functions_and_decorators():
    source = "\n".join(
        [
            "@decorator",  # 1
            "def top():",
            *(["    x = 1"] * 3),
            "class A:",  # 6
            "    def method(self):",
            "        def inner():",
            *(["            x = 1"] * 3),
            "        return inner",
        ]
    )
    assert long_functions(source, 3) == [("top", 1, 5), ("method", 7, 6), ("inner", 8, 4)]
    assert long_functions(source, 6) == []


def test_no_function_over_60_lines():
    found = [
        f"{module.relative_to(REPO)}:{line} {name} is {n} lines"
        for module in modules()
        for name, line, n in long_functions(module.read_text(), MAX_FUNCTION_LINES)
    ]
    assert not found, found


def test_no_module_over_500_lines():
    sizes = {module: len(module.read_text().splitlines()) for module in modules()}
    found = [f"{m.relative_to(REPO)} is {n} lines" for m, n in sizes.items() if n > MAX_MODULE_LINES]
    assert not found, f"{found}: split each by what its parts do"
