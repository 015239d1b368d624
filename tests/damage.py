"""Seeded damage to the files jobgen reads: every way a file of a run, a sweep or a server can
be not what jobgen wrote, derived from a valid file of its kind.

``damages(kind, path, seed, count)`` takes the valid file at ``path`` and returns ``count``
of its damages (all of them with ``count=None``), always the same ones for the same seed:

- for each key path of the JSON (each key of each object, each item of each list; of one
  line at a time in a JSONL file): the value replaced by each JSON type it is not (null,
  booleans, numbers, strings, lists, objects), by numbers no reader can compute with
  (10**400, an integer of 5000 digits, 1e308, 1e400, NaN, Infinity), by a string of
  terminal escapes (OSC title and clipboard, clear screen, a bidirectional override, a
  newline with a fake line after it), or the key removed;
- the text: empty, cut at several offsets, bytes that are no UTF-8, nested too deep to
  parse, another JSON type as a whole, garbage;
- what is at the name: a directory, a FIFO, a symbolic link to /dev/zero, to a FIFO, to
  another file (a teammate's), dangling.

:func:`place` puts one at its path. A test then runs every command that reads the file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# JSON tokens json.dumps cannot write: put into the text in place of a marker string.
HUGE_INT = "1" + "0" * 400
RAW_TOKENS = (HUGE_INT, "-" + HUGE_INT, "9" * 5000, "1e308", "1e400", "-1e400", "NaN", "Infinity", "-Infinity")
# Every JSON type, and values at the edges of what a reader may assume.
WRONG_VALUES: tuple[Any, ...] = (None, True, False, 0, -1, 2**63, 1.5, "", "text", "²", [], {}, [1, "a"], {"a": 1})
# What a hostile teammate writes into a field that is printed: an OSC window title, an OSC 52
# clipboard write, clear screen, a one-byte C1 CSI, a bidirectional override, a carriage
# return and a newline with a fake line after it.
HOSTILE = "\x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\x9b31m\u202eevil\rX\nFAKE jobgen: ok"
SPECIAL = (
    "a directory",
    "a FIFO",
    "a link to /dev/zero",
    "a link to a FIFO",
    "a link to another file",
    "a dangling link",
)


@dataclass(frozen=True)
class Damage:
    """One way a file is damaged: ``content`` (bytes) written at its name, or ``special``
    (one of SPECIAL) put there instead."""

    what: str
    content: bytes | None = None
    special: str | None = None


def _marker(token: str) -> str:
    return f"@@raw:{token}@@"


def dump(value: Any) -> bytes:
    """``value`` as JSON text, with each marker string put back as its raw token."""
    text = json.dumps(value)
    for token in RAW_TOKENS:
        text = text.replace(json.dumps(_marker(token)), token)
    return text.encode()


def key_paths(value: Any, prefix: tuple = (), limit: int = 400) -> list[tuple]:
    """Every key path under ``value`` (objects' keys, lists' indices), outermost first."""
    out: list[tuple] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        if len(out) >= limit:
            break
        out.append((*prefix, key))
        out += key_paths(child, (*prefix, key), limit - len(out))
    return out


def _replaced(value: Any, path: tuple, new: Any, remove: bool = False) -> Any:
    """A copy of ``value`` with the item at ``path`` set to ``new`` (or removed)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = dict(value) if isinstance(value, dict) else list(value)
    if rest:
        copy[head] = _replaced(value[head], rest, new, remove)
    elif remove:
        del copy[head]
    else:
        copy[head] = new
    return copy


def _shown(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "(the whole)"


def value_damages(value: Any) -> Iterator[tuple[str, Any]]:
    """(what, damaged value) for every key path of ``value``."""
    for path in key_paths(value):
        where = _shown(path)
        for new in (*WRONG_VALUES, *map(_marker, RAW_TOKENS), HOSTILE):
            yield f"{where} = {new!r}"[:120], _replaced(value, path, new)
        yield f"{where} removed", _replaced(value, path, None, remove=True)


def text_damages(text: bytes) -> Iterator[Damage]:
    """The file as a whole: empty, cut, not UTF-8, too deep, the wrong JSON type, garbage."""
    for cut in sorted({1, 2, len(text) // 3, len(text) // 2, len(text) - 2, len(text) - 1}):
        if 0 < cut < len(text):
            yield Damage(f"cut at byte {cut}", text[:cut])
    yield Damage("empty", b"")
    yield Damage("not UTF-8", text[: len(text) // 2] + b"\xff\xfe\xc3(" + text[len(text) // 2 :])
    yield Damage("nested too deep", b"[" * 100_000 + b"]" * 100_000)
    for whole in ("[]", "{}", "null", "7", '"text"', "[1, 2]", HUGE_INT, "NaN"):
        yield Damage(f"the whole file is {whole[:20]}", whole.encode())
    yield Damage("garbage", b"\x00\x01garbage\x1b[2J{")
    yield Damage("terminal escapes", HOSTILE.encode())


def json_damages(text: bytes) -> Iterator[Damage]:
    """Damages of a JSON file: each value of each key path, then the text as a whole."""
    value = json.loads(text)
    for what, damaged in value_damages(value):
        yield Damage(what, dump(damaged))
    yield from text_damages(text)


def jsonl_damages(text: bytes) -> Iterator[Damage]:
    """Damages of a JSONL file: each value of each line's key paths (that line alone
    damaged), a line of another JSON type, then the text as a whole."""
    lines = text.decode().splitlines()
    for number, line in enumerate(lines):
        for what, damaged in value_damages(json.loads(line)):
            changed = [*lines[:number], dump(damaged).decode(), *lines[number + 1 :]]
            yield Damage(f"line {number + 1}: {what}", ("\n".join(changed) + "\n").encode())
    for whole in ("[1, 2]", '"text"', "null", HUGE_INT, "{", HOSTILE):
        yield Damage(f"a line {whole[:20]!r}", ("\n".join([lines[0], whole, *lines[1:]]) + "\n").encode())
    yield from text_damages(text)


def damages(path: Path, seed: int, count: int | None) -> list[Damage]:
    """``count`` damages of the valid file at ``path`` (JSONL by its suffix), chosen with
    ``seed``; the special ones (not a file, links) always among them."""
    text = path.read_bytes()
    every = list((jsonl_damages if path.suffix == ".jsonl" else json_damages)(text))
    chosen = every if count is None or count >= len(every) else random.Random(seed).sample(every, count)
    return [*chosen, *(Damage(what, special=what) for what in SPECIAL)]


def remove(path: Path) -> None:
    """Whatever is at ``path`` (a file, a link, a FIFO, a directory) removed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def place(path: Path, damage: Damage, elsewhere: Path) -> None:
    """Put ``damage`` at ``path``; ``elsewhere`` is a directory outside the run for the
    FIFO and file a link leads to."""
    remove(path)
    if damage.content is not None:
        path.write_bytes(damage.content)
        return
    fifo = elsewhere / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    other = elsewhere / "teammates-file.json"
    other.write_text('{"run": {}, "site": {}, "points": [], "nodes": {}}')
    if damage.special == "a directory":
        path.mkdir()
        (path / "inside").write_text("{}")
    elif damage.special == "a FIFO":
        os.mkfifo(path)
    else:
        target = {
            "a link to /dev/zero": Path("/dev/zero"),
            "a link to a FIFO": fifo,
            "a link to another file": other,
            "a dangling link": elsewhere / "nothing-here",
        }[damage.special]
        path.symlink_to(target)
