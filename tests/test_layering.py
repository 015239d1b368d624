"""Dependencies point one way (design.md, "Architecture"): ``trainer/`` and ``watchdogs/``
use ``jobgen/``; ``jobgen/`` uses neither, except ``jobgen/cli.py``, the composition root
that wires every subcommand together; ``trainer/`` does not use ``watchdogs/``.

Every module is parsed, not imported: imports at module level, inside functions and
under ``if TYPE_CHECKING`` all count, and so do ``importlib.import_module`` /
``__import__`` calls whose module name is a literal (or an f-string with a literal start).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("jobgen", "trainer", "watchdogs")

# (package, what it must not import, modules exempt from the rule)
RULES = [
    ("jobgen", ("trainer", "watchdogs"), {"jobgen/cli.py"}),
    ("trainer", ("watchdogs",), set()),
]


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def imports(path: Path, root: Path = REPO) -> Iterator[tuple[int, str, str]]:
    """(line, imported module, source text) of every import in the file, at any depth."""
    package = list(path.relative_to(root).parent.parts)  # jobgen/devcluster/state.py: jobgen.devcluster
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module, ast.unparse(node)
            for alias in node.names:  # ``from jobgen import x`` may name a submodule x
                yield node.lineno, f"{module}.{alias.name}", ast.unparse(node)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name not in ("import_module", "__import__"):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value, ast.unparse(node)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                yield node.lineno, str(arg.values[0].value), ast.unparse(node)


def _is_in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations() -> list[str]:
    found = []
    for path in modules():
        rel = path.relative_to(REPO).as_posix()
        for package, forbidden, exempt in RULES:
            if not _is_in(rel.replace("/", ".").removesuffix(".py"), package) or rel in exempt:
                continue
            for line, module, text in imports(path):
                for other in forbidden:
                    if _is_in(module, other):
                        found.append(f"{rel}:{line}: `{text}`: {package}/ must not import {other}/")
    return sorted(set(found))


def test_every_package_is_parsed():
    names = {p.relative_to(REPO).as_posix() for p in modules()}
    assert {"jobgen/cli.py", "jobgen/status.py", "trainer/loop.py", "watchdogs/base.py"} <= names
    assert any(n.startswith("jobgen/devcluster/") for n in names)


def test_function_level_imports_are_seen():
    """The composition root imports trainer and watchdogs inside functions; the walker must see that,
    or the rules below would pass for the wrong reason."""
    seen = {module for _, module, _ in imports(REPO / "jobgen" / "cli.py")}
    assert any(_is_in(m, "trainer") for m in seen) and any(_is_in(m, "watchdogs") for m in seen), seen


def test_relative_imports_are_resolved(tmp_path: Path):
    pkg = tmp_path / "jobgen" / "sub"
    pkg.mkdir(parents=True)
    module = pkg / "m.py"
    module.write_text("def f():\n    from ...watchdogs import base\n    from .. import spec\n")
    found = [(line, m) for line, m, _ in imports(module, root=tmp_path)]
    assert (2, "watchdogs") in found and (2, "watchdogs.base") in found and (3, "jobgen.spec") in found


def test_dependencies_point_one_way():
    problems = violations()
    assert not problems, "imports against the one-way layout (design.md, Architecture):\n" + "\n".join(problems)
