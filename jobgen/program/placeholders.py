"""Placeholders in ``[command] args``, ``[command] resume_args`` and ``[env]`` values of a
``program = "command"`` run: ``{run_dir}``, ``{checkpoint_dir}``, ``{latest_checkpoint}``,
``{job_id}``, ``{task}``; ``{{`` and ``}}`` are literal braces.

jobgen expands them in Python, once per array task (:mod:`jobgen.launch.command_plan`), and hands
the words to the program as they are: no shell ever reads them, so a value may hold any
printable text. The syntax is a deliberately small subset of ``str.format``: a name and
nothing else (no ``{0}``, ``{a.b}``, ``{a!r}`` or ``{a:>8}``), so that a typo is an error
that names its key at ``jobgen validate``, never a KeyError or a silently odd argument on
the cluster.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

RUN_DIR, CHECKPOINT_DIR, LATEST_CHECKPOINT, JOB_ID, TASK = (
    "run_dir",
    "checkpoint_dir",
    "latest_checkpoint",
    "job_id",
    "task",
)
NAMES = (RUN_DIR, CHECKPOINT_DIR, LATEST_CHECKPOINT, JOB_ID, TASK)
# args are the words of every task; the checkpoint is the one thing that differs between a
# fresh start and a resume, so it belongs where that difference is spelled (resume_args).
IN_ARGS = frozenset(NAMES) - {LATEST_CHECKPOINT}
IN_RESUME_ARGS = frozenset(NAMES)
IN_ENV = frozenset(NAMES)

# One token: an escaped brace, a placeholder, or a lone brace (an error).
_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


class PlaceholderError(ValueError):
    """A value whose braces are not the placeholder syntax, or name an unknown or a
    misplaced placeholder; the message says which and how to write a literal brace."""


def _tokens(text: str) -> Iterable[tuple[str, str | None]]:
    """(token text, placeholder name or None) of every brace construct in ``text``."""
    for match in _TOKEN.finditer(text):
        yield match.group(0), match.group(1)


def names_in(text: str) -> list[str]:
    """The placeholders ``text`` uses, in order (checked: see :func:`check`)."""
    return [name for token, name in _tokens(text) if name is not None]


def check(text: str, allowed: frozenset[str], where: str) -> str:
    """``text`` if its braces are well formed and name only ``allowed`` placeholders; else a
    :class:`PlaceholderError`. ``where`` names the place in the message ('command.args')."""
    for token, name in _tokens(text):
        if token in ("{{", "}}"):
            continue
        if name is None:
            raise PlaceholderError(
                f"a lone {token!r}: placeholders are {{name}}, and a literal brace is written twice ({token * 2})"
            )
        if name not in NAMES:
            known = ", ".join("{" + n + "}" for n in NAMES)
            raise PlaceholderError(
                f"unknown placeholder {token} (known: {known}; write {{{{ and }}}} for literal braces)"
            )
        if name not in allowed:
            raise PlaceholderError(_misplaced(name, where))
    return text


def _misplaced(name: str, where: str) -> str:
    if name == LATEST_CHECKPOINT:
        return (
            f"{{{name}}} cannot be used in {where}: the first task has no checkpoint. Put the words that "
            'resume in command.resume_args (e.g. ["--resume_from_checkpoint", "{latest_checkpoint}"]), which '
            "are added only when a checkpoint exists"
        )
    return f"{{{name}}} cannot be used in {where}"


def expand(text: str, values: Mapping[str, str]) -> str:
    """``text`` with every placeholder replaced by its value and ``{{``/``}}`` by one brace.
    ``text`` was checked at load time; a name without a value here is a jobgen bug (KeyError)."""

    def replace(match: re.Match[str]) -> str:
        token, name = match.group(0), match.group(1)
        if name is not None:
            return values[name]
        if token in ("{{", "}}"):
            return token[0]
        raise PlaceholderError(f"a lone {token!r} in {text!r}")  # refused at load time

    return _TOKEN.sub(replace, text)


def uses_placeholders(text: str) -> bool:
    """Whether ``text`` names a placeholder (escaped braces alone do not count)."""
    return bool(names_in(text))
