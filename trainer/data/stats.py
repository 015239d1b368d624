"""What preprocessing did to the data: :class:`DataStats` and its ``stats.json`` file.

Below both :mod:`trainer.data.build`, which counts, and :mod:`trainer.data.cache`, which
keeps the counts next to each cached entry and reads them back on reuse.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


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
        return cls(**{f.name: int(data[f.name]) for f in dataclasses.fields(cls)})

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
    return DataStats.from_dict(json.loads(Path(path).read_text()))
