"""Memory sizes as people write them: ``'80GiB'``, ``'24G'``, ``'500MiB'`` to bytes, and bytes back.

Site profiles keep ``slurm.device_memory`` as written; the memory plan, the site check and
the trainer's device cap all read it through :func:`parse_size`.
"""

from __future__ import annotations

import re

KIB, MIB, GIB = 2**10, 2**20, 2**30

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?B?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes of a human size: '80GiB', '80G' and '80g' are binary (as Slurm's --mem), '80GB' is
    decimal, a bare number is bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size like '24GiB', '80G', '500MiB' or '80GB'")
    number, unit, suffix = float(match[1]), match[2].upper(), match[3]
    power = "KMGTP".index(unit) + 1 if unit else 0
    base = 1000 if suffix.upper() == "B" and unit else 1024
    return int(number * base**power)


def format_bytes(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.0f} MiB"
