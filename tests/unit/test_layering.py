"""Dependencies point one way (``docs/architecture.md``, "The dependency rule"): ``trainer/``
and ``watchdogs/`` use ``jobgen/``; ``jobgen/`` uses neither, except ``jobgen/cli/main.py``, the
composition root that wires every subcommand together; ``trainer/`` does not use ``watchdogs/``.

Every module is parsed, not imported: imports at module level, inside functions and
under ``if TYPE_CHECKING`` all count, and so do ``importlib.import_module`` /
``__import__`` calls whose module name is a literal (or an f-string with a literal start).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from helpers import REPO

PACKAGES = ("jobgen", "trainer", "watchdogs")

# (package, what it must not import, modules exempt from the rule)
RULES = [
    ("jobgen", ("trainer", "watchdogs"), {"jobgen/cli/main.py"}),
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
    assert {"jobgen/cli/main.py", "jobgen/report/status.py", "trainer/loop.py", "watchdogs/base.py"} <= names
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
    assert (2, "watchdogs") in found and (2, "watchdogs.base") in found and (3, "jobgen.spec.tables.run") in found


def test_dependencies_point_one_way():
    problems = violations()
    assert not problems, "imports against the one-way layout (docs/architecture.md):\n" + "\n".join(problems)


def module_name(path: Path, root: Path = REPO) -> str:
    return path.relative_to(root).as_posix().removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def import_graph(paths: list[Path], root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports, at any depth (inside functions too).
    ``from pkg import sub`` is an edge to ``pkg.sub`` alone when that is a module: Python then
    imports the submodule, with no cycle through the package's own __init__."""
    names = {module_name(p, root): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        found = {m for _, m, _ in imports(path, root) if m in names and m != name}
        graph[name] = {m for m in found if not any(other.startswith(m + ".") for other in found)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_sees_function_level_cycles(tmp_path: Path):
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from trainer.b import X\n")
    (pkg / "b.py").write_text("def f():\n    from trainer.a import Y\n")
    (pkg / "c.py").write_text("from trainer import a\n")
    graph = import_graph(sorted(pkg.glob("*.py")), root=tmp_path)
    assert cycles(graph) == [["trainer.a", "trainer.b"]] and graph["trainer.c"] == {"trainer.a"}


def test_no_import_cycles():
    """A cycle hidden behind an import inside a function still ties two modules together: each
    can only be understood, tested and moved with the other. What both need goes below both."""
    found = cycles(import_graph(modules()))
    assert not found, "import cycles (move what both need below both):\n" + "\n".join(" <-> ".join(c) for c in found)
