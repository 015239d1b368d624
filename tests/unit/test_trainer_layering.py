"""Inside ``trainer/`` the rooms form a DAG (:data:`trainer.ROOMS`): every subpackage is a room,
and so is every module directly in trainer/; each room may import only the rooms the table
allows it (and jobgen, always). What two rooms both need goes below both.

Every module is parsed, not imported, with test_layering's walker: imports at module level,
inside functions and under ``if TYPE_CHECKING`` all count, and so do ``importlib.import_module``
/ ``__import__`` calls whose module name is a literal.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import imports

import trainer
from helpers import REPO

ROOMS: dict[str, set[str]] = {room: set(allowed) for room, allowed in trainer.ROOMS.items()}


def rooms_in(root: Path = REPO) -> set[str]:
    """The rooms trainer/ holds: its subpackages and the modules directly in it (``__init__`` not)."""
    package = root / "trainer"
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    return subpackages | modules


def room_of(module: str, rooms: set[str]) -> str | None:
    """The room of a trainer module (trainer.parallel.strategies: parallel; trainer.loop: loop),
    None outside trainer's rooms (jobgen, torch, the package trainer itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "trainer" and len(parts) > 1 and parts[1] in rooms else None


def modules(root: Path = REPO) -> list[Path]:
    return sorted(p for p in (root / "trainer").rglob("*.py") if "__pycache__" not in p.parts)


def room_violations(paths: list[Path], table: dict[str, set[str]] = ROOMS, root: Path = REPO) -> list[str]:
    """file:line, the import's text and the arrow it draws, for every import of a room the
    importing room may not import."""
    rooms = rooms_in(root)
    found = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        room = room_of(rel.removesuffix(".py").replace("/", "."), rooms)
        if room is None:
            continue  # trainer/__init__.py: test_the_package_itself_imports_nothing
        allowed = table.get(room)
        if allowed is None:
            found.append(f"{rel}: the room trainer/{room} is not in trainer.ROOMS")
            continue
        for line, module, text in imports(path, root):
            other = room_of(module, rooms)
            if other is None or other == room or "*" in allowed or other in allowed:
                continue
            found.append(f"{rel}:{line}: `{text}`: trainer/{room} may not import trainer/{other}")
    return sorted(set(found))


def test_rooms_import_only_the_rooms_below_them():
    problems = room_violations(modules())
    assert not problems, "imports against trainer's rooms (trainer.ROOMS):\n" + "\n".join(problems)


def order_problems(table: dict[str, set[str]]) -> list[str]:
    """Each room that may import itself, a room not in the table, or a room listed after it:
    none, and the table is a DAG (every arrow points to a room listed earlier)."""
    order = list(table)
    found = []
    for room, allowed in table.items():
        for other in sorted(allowed - {"*"}):
            if other not in table:
                found.append(f"{room} -> {other}: not a room")
            elif order.index(other) >= order.index(room):
                found.append(f"{room} -> {other}: {other} is not below {room}")
    return found


def test_the_rooms_are_a_dag_lowest_first():
    assert not order_problems(ROOMS), order_problems(ROOMS)


def test_a_cycle_in_the_table_is_seen():
    cyclic = {"low": {"high"}, "high": {"low"}, "self": {"self"}, "odd": {"absent"}}
    assert order_problems(cyclic) == [
        "low -> high: high is not below low",
        "self -> self: self is not below self",
        "odd -> absent: not a room",
    ]


def test_every_subpackage_and_module_of_trainer_is_a_room():
    """A dict holds each room once; each subpackage and each module directly in trainer/ is one
    of them, and every room of the table is there."""
    assert rooms_in() == set(ROOMS), rooms_in() ^ set(ROOMS)


def test_the_package_itself_imports_nothing():
    """``import trainer`` (for its ROOMS) must stay cheap: no torch, and no room of its own."""
    tree = ast.parse((REPO / "trainer" / "__init__.py").read_text())
    found = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert all(text.startswith("from __future__ ") for text in found), found


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in {"trainer/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_room_importing_a_room_above_it_is_seen(tmp_path: Path):
    """A back-arrow inside a function, another under TYPE_CHECKING, a room missing from the
    table: each is named with its file and line. Imports of jobgen, of the package itself and
    within a room are not arrows."""
    _tree(
        tmp_path,
        {
            "trainer/low/__init__.py": "",
            "trainer/low/m.py": "import jobgen.base\nfrom trainer import ROOMS\nfrom trainer.low import n\n"
            "def f():\n    from trainer.high import x\n",
            "trainer/low/n.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trainer.top\n",
            "trainer/high/__init__.py": "from trainer.low.m import f\n",
            "trainer/top.py": "from trainer import high, low\n",
            "trainer/loose.py": "",
        },
    )
    table = {"low": set(), "high": {"low"}, "top": {"low", "high"}}
    assert room_violations(modules(tmp_path), table, tmp_path) == [
        "trainer/loose.py: the room trainer/loose is not in trainer.ROOMS",
        "trainer/low/m.py:5: `from trainer.high import x`: trainer/low may not import trainer/high",
        "trainer/low/n.py:3: `import trainer.top`: trainer/low may not import trainer/top",
    ]
    assert rooms_in(tmp_path) == {"low", "high", "top", "loose"}
