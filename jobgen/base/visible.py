"""Text from files, made safe to print on a terminal.

Everything jobgen prints that comes from a file of a run, a sweep or a server (a status
reason, a prompt and its completion, a point's name, a watchdog's alert, a switch's file
name) was written by a program or a teammate, not by jobgen. A terminal acts on the control
characters in it: ESC starts sequences that move the cursor, clear the screen, set the
window title, write the clipboard (OSC 52) or make a link; a carriage return overwrites the
line; a bidirectional override makes what is shown read differently from what is there.
So every such text goes through :func:`visible` (one field, one line) or
:func:`visible_lines` (a block of lines) before it is printed, and those characters are
shown as escapes instead, as Python writes them: ``\\x1b``, ``\\r``, ``\\u202e``.

What is escaped: the C0 controls (U+0000-U+001F), DEL (U+007F), the C1 controls
(U+0080-U+009F: U+009B is a one-byte CSI on some terminals), and the bidirectional controls
(U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), and the Unicode line and paragraph
separators (U+2028, U+2029). In one field the newline and the tab are escaped too: a field is one line of a table or a
message, and a newline in it could print a line that looks like jobgen's own. In a block
(:func:`visible_lines`) newlines and tabs stay: they only move the cursor forwards.

A backslash is left as it is: the escapes are for a person to read, not to be parsed back.
``--json`` output needs none of this: ``json.dumps`` writes every control and every
non-ASCII character as a ``\\u`` escape. ``jobgen logs`` prints the merged lines of the
user's own program as they are (its prefixes, which come from file names and records, are
made visible).
"""

from __future__ import annotations

# The bidirectional controls, and the Unicode line and paragraph separators.
_UNICODE = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029)
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(code: int) -> str:
    return _SHORT.get(chr(code)) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def _table(keep: str) -> dict[int, str]:
    codes = (*range(0x20), 0x7F, *range(0x80, 0xA0), *_UNICODE)
    return {code: _escape(code) for code in codes if chr(code) not in keep}


_FIELD = _table(keep="")
_LINES = _table(keep="\n\t")


def visible(text: object) -> str:
    """``text`` (any value, as ``str()`` writes it) as one line with every control character
    shown as an escape: for a field of a table, a name, a reason, a message."""
    return str(text).translate(_FIELD)


def visible_lines(text: object) -> str:
    """``text`` as lines: newlines and tabs kept, every other control character shown as an
    escape: for a block of several lines (an error that lists problems, a formatted table
    whose fields were made visible already)."""
    return str(text).translate(_LINES)
