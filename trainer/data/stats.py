"""What preprocessing did to the data: :class:`DataStats` and its ``stats.json`` file.

Below both :mod:`trainer.data.build`, which counts, and :mod:`trainer.data.cache`, which
keeps the counts next to each cached entry and reads them back on reuse. A cache entry may
have been planted or damaged by someone else, so ``stats.json`` is read as a run's files are
(:mod:`jobgen.base.safe_read`: a small regular file, no link followed, never waiting on a FIFO)
and each count must be one: anything else is a :class:`DataCacheError` of one line naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jobgen.base.safe_read import DamagedFile, is_int, read_json
from jobgen.base.visible import visible
from trainer.data.examples import DataCacheError

# The most bytes of stats.json: the counts and the fingerprint's inputs, well under a KiB.
STATS_LIMIT = 1 << 20


@dataclasses.dataclass(frozen=True)
class DataStats:
    """What preprocessing did, for the log and ``stats.json``."""

    examples_in: int
    kept: int
    truncated: int  # examples longer than max_length, cut to it (dropped ones included)
    dropped: int  # examples without any target token after truncation
    total_tokens: int  # over kept examples
    target_tokens: int  # over kept examples
    longest: int  # longest example before truncation, in tokens

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataStats:
        """The counts in ``data`` (other keys ignored); ValueError naming the first that is
        missing or no count (a non-negative integer: not a bool, a float or a string)."""
        if not isinstance(data, dict):
            raise ValueError("not an object of counts")
        for field in dataclasses.fields(cls):
            if field.name not in data:
                raise ValueError(f"{field.name}: missing")
            value = data[field.name]
            if not (is_int(value) and value >= 0):
                raise ValueError(f"{field.name}: {visible(repr(value))[:80]} is not a count (an integer of at least 0)")
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    def summary(self) -> str:
        return (
            f"{self.kept}/{self.examples_in} examples kept, {self.truncated} truncated, {self.dropped} dropped "
            f"(no target token left); {self.total_tokens} tokens, {self.target_tokens} targets; "
            f"longest {self.longest} tokens"
        )


def write_stats(path: Path, stats: DataStats, extra: dict[str, Any] | None = None) -> None:
    from jobgen.base.atomic import write_json_atomic

    write_json_atomic(path, {**stats.to_dict(), **(extra or {})})


def read_stats(path: Path) -> DataStats:
    """The counts in ``stats.json`` at ``path``; DataCacheError naming it when it is missing, no
    small regular file, no JSON or not the counts."""
    try:
        return DataStats.from_dict(read_json(Path(path), STATS_LIMIT))
    except FileNotFoundError:
        raise DataCacheError(f"{visible(path)}: missing") from None
    except DamagedFile as exc:
        raise DataCacheError(str(exc)) from None
    except ValueError as exc:
        raise DataCacheError(f"{visible(path)}: {exc}") from None
