"""Dependencies point one way (``docs/architecture.md``, "The dependency rule"): ``trainer/``
and ``watchdogs/`` use ``jobgen/``; ``jobgen/`` uses neither, except ``jobgen/cli/``, the
composition root that wires every subcommand together; ``trainer/`` does not use ``watchdogs/``.
Inside ``jobgen/`` the rooms form a DAG (:data:`ROOMS`): each may import only the rooms below it.

Every module is parsed, not imported: imports at module level, inside functions and
under ``if TYPE_CHECKING`` all count, and so do ``importlib.import_module`` /
``__import__`` calls whose module name is a literal (or an f-string with a literal start).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import jobgen
from helpers import REPO

PACKAGES = ("jobgen", "trainer", "watchdogs")

# (package, what it must not import, modules exempt from the rule)
RULES = [
    ("jobgen", ("trainer", "watchdogs"), {"jobgen/cli/main.py"}),
    ("trainer", ("watchdogs",), set()),
]

# The rooms of jobgen/ and the rooms each may import besides itself: jobgen.ROOMS.
ROOMS: dict[str, set[str]] = {room: set(allowed) for room, allowed in jobgen.ROOMS.items()}


def modules() -> list[Path]:
    # jobgen/bundled/ is the package's data (the examples a user copies import jobgen as a user's program does).
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "bundled" not in p.parts)


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
    seen = {module for _, module, _ in imports(REPO / "jobgen" / "cli" / "main.py")}
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
    assert not problems, "imports against the one-way layout (docs/architecture.md):\n" + "\n".join(problems)


def room_of(module: str) -> str | None:
    """The room of a jobgen module (jobgen.spec.tables.run: spec), None outside jobgen's rooms."""
    parts = module.split(".")
    return parts[1] if parts[0] == "jobgen" and len(parts) > 2 else None


def room_violations(paths: list[Path], root: Path = REPO) -> list[str]:
    found = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        room = room_of(module_name(path, root) + ".x")
        if room is None:
            continue
        allowed = ROOMS.get(room)
        if allowed is None:
            found.append(f"{rel}: the room jobgen/{room}/ is not in the table of rooms (tests/unit/test_layering.py)")
            continue
        for line, module, text in imports(path, root):
            other = room_of(module)
            if other is None or other == room or "*" in allowed or other in allowed:
                continue
            found.append(f"{rel}:{line}: `{text}`: jobgen/{room}/ may not import jobgen/{other}/")
    return sorted(set(found))


def test_the_rooms_are_a_dag_lowest_first():
    order = list(ROOMS)
    for room, allowed in ROOMS.items():
        assert all(order.index(o) < order.index(room) for o in allowed if o != "*"), room


def test_every_module_of_jobgen_lives_in_a_room():
    loose = [p.name for p in (REPO / "jobgen").glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert not loose, f"modules directly in jobgen/ (each belongs in a room): {loose}"
    rooms = {p.parent.name for p in (REPO / "jobgen").glob("*/__init__.py")}
    assert rooms == set(ROOMS), rooms ^ set(ROOMS)


MAX_MODULES_PER_PACKAGE = 15  # a folder a newcomer can read at a glance (issue 31)


def crowded_packages(root: Path = REPO) -> dict[str, int]:
    """Every package (at any depth) of jobgen/, trainer/ and watchdogs/ with more modules than
    MAX_MODULES_PER_PACKAGE directly in it (``__init__`` not counted)."""
    crowded = {}
    for package in PACKAGES:
        for init in (root / package).rglob("__init__.py"):
            count = sum(1 for p in init.parent.glob("*.py") if p.name != "__init__.py")
            if count > MAX_MODULES_PER_PACKAGE:
                crowded[init.parent.relative_to(root).as_posix()] = count
    return crowded


def test_no_package_holds_more_than_fifteen_modules():
    assert not crowded_packages(), f"packages to split into rooms: {crowded_packages()}"


def test_a_crowded_package_is_seen(tmp_path: Path):
    crowded = tmp_path / "trainer"
    crowded.mkdir()
    for name in ["__init__", *(f"m{i}" for i in range(MAX_MODULES_PER_PACKAGE + 1))]:
        (crowded / f"{name}.py").write_text("")
    assert crowded_packages(tmp_path) == {"trainer": MAX_MODULES_PER_PACKAGE + 1}


def test_a_room_importing_a_room_above_it_is_seen(tmp_path: Path):
    low = tmp_path / "jobgen" / "base"
    low.mkdir(parents=True)
    (low / "m.py").write_text("def f():\n    from jobgen.report import status\n")
    assert room_violations([low / "m.py"], root=tmp_path) == [
        "jobgen/base/m.py:2: `from jobgen.report import status`: jobgen/base/ may not import jobgen/report/"
    ]


def test_rooms_import_only_the_rooms_below_them():
    problems = room_violations(modules())
    assert not problems, "imports against the rooms' DAG (tests/unit/test_layering.py ROOMS):\n" + "\n".join(problems)


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


def test_entry_points_of_scripts_rendered_before_the_rooms_still_run(tmp_path: Path):
    """A queued task runs its batch script as it was submitted: ``python -m jobgen.sweep_claim``
    from before the rooms runs jobgen.sweep.claim. Every ``-m jobgen.X`` the golden scripts of
    before the rooms named (git 40560c9) is one of jobgen.MOVED_ENTRY_POINTS."""
    import importlib.util
    import subprocess
    import sys

    before = {"jobgen.sweep_claim", "jobgen.command_plan", "jobgen.quarantine", "jobgen.repro"}
    before |= {"jobgen.serve_node", "jobgen.serve_uds"}
    assert before == set(jobgen.MOVED_ENTRY_POINTS)
    for old, new in jobgen.MOVED_ENTRY_POINTS.items():
        found = importlib.util.find_spec(old)
        assert found is not None and found.origin == str(REPO / (new.replace(".", "/") + ".py")), (old, found)
    for old in ("jobgen.sweep_claim", "jobgen.command_plan"):  # as a batch script runs them
        proc = subprocess.run(
            [sys.executable, "-m", old, "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=60, check=False
        )
        assert proc.returncode == 0 and "usage:" in proc.stdout, (old, proc.stdout + proc.stderr)
