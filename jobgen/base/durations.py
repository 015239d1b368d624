"""Durations in Slurm syntax (``20:00:00``, ``2-00:00:00``) and human syntax (``10m``, ``1h30m``).

Every duration in a spec is stored as whole seconds and rendered back to Slurm's
``D-HH:MM:SS`` form, so the number the user typed and the number Slurm sees are one
value. A bare number is refused: Slurm reads ``30`` as minutes while most people read
it as seconds, and a time limit off by 60x is the kind of mistake nobody notices
until the job dies.
"""

from __future__ import annotations

import re

_HUMAN = re.compile(r"^(?:(?P<d>\d+)d)?(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m(?!s))?(?:(?P<s>\d+)s)?$")
_SLURM_DAYS = re.compile(r"^(?P<d>\d+)-(?P<rest>\d+(?::\d+){0,2})$")
_SLURM_CLOCK = re.compile(r"^\d+(?::\d+){1,2}$")


class DurationError(ValueError):
    """A duration string that is neither Slurm nor human syntax."""


def parse_duration(value: object) -> int:
    """Return the duration in seconds.

    Accepted: ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS`` (Slurm) and
    ``90s``, ``10m``, ``2h``, ``1d``, ``1h30m`` (human). Integers are refused on purpose.
    """
    if isinstance(value, bool) or not isinstance(value, str):
        raise DurationError(
            f"expected a string such as '30m', '2h' or '04:00:00', got {value!r}"
            " (a bare number is ambiguous: Slurm reads it as minutes)"
        )
    text = value.strip().lower().replace(" ", "")
    if not text:
        raise DurationError("empty duration")
    if text.isdigit():
        raise DurationError(f"'{value}' has no unit: write '{text}m' or '{text}s' (Slurm would read it as minutes)")
    human = _HUMAN.match(text)
    if human and any(human.groupdict().values()):
        parts = {k: int(v or 0) for k, v in human.groupdict().items()}
        return parts["d"] * 86400 + parts["h"] * 3600 + parts["m"] * 60 + parts["s"]
    days = _SLURM_DAYS.match(text)
    if days:
        fields = [int(x) for x in days.group("rest").split(":")]
        fields += [0] * (3 - len(fields))  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = fields
        _check_clock(value, minutes, seconds)
        return int(days.group("d")) * 86400 + hours * 3600 + minutes * 60 + seconds
    if _SLURM_CLOCK.match(text):
        fields = [int(x) for x in text.split(":")]
        if len(fields) == 2:  # Slurm's MM:SS
            minutes, seconds = fields
            _check_clock(value, 0, seconds)
            return minutes * 60 + seconds
        hours, minutes, seconds = fields
        _check_clock(value, minutes, seconds)
        return hours * 3600 + minutes * 60 + seconds
    raise DurationError(
        f"cannot read '{value}' as a duration: use Slurm syntax ('04:00:00', '2-00:00:00')"
        " or human syntax ('90s', '10m', '1h30m', '2d')"
    )


def _check_clock(original: str, minutes: int, seconds: int) -> None:
    if minutes >= 60 or seconds >= 60:
        raise DurationError(f"'{original}': minutes and seconds must be below 60")


def format_slurm(seconds: int) -> str:
    """Slurm's ``[D-]HH:MM:SS``; the days field only when needed."""
    if seconds < 0:
        raise DurationError(f"negative duration: {seconds}")
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{clock}" if days else clock


def format_human(seconds: int) -> str:
    """Short human form for messages: ``1h30m``, ``45s``, ``2d``."""
    seconds = int(seconds)
    if seconds == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)


def parse_slurm_limit(text: str) -> int | None:
    """A limit as ``scontrol``/``sinfo`` prints it (``1-00:00:00``, ``UNLIMITED``, ``INFINITE``);
    ``None`` means no limit."""
    text = text.strip()
    if text.upper() in {"UNLIMITED", "INFINITE", "NONE", "N/A", ""}:
        return None
    return parse_duration(text)
