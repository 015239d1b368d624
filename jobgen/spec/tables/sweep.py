"""The ``[sweep]`` table of ``run.toml``: many runs from one file, as one Slurm array.

    [sweep]
    max_parallel = 2                 # at most 2 points running at once
    seeds = 2                        # each point twice: train.seed = base seed + 0, + 1
    [sweep.grid]                     # the cross product, in the order written
    "train.lr" = [1e-4, 3e-4]
    "model.lora.r" = [8, 16]

Keys are dotted paths into the run document. This model checks what can be checked
from the table alone (the keys' spelling, the keys a sweep may not change, that there
is a point at all); :mod:`jobgen.sweep.points` expands the points and validates each
one as a run. Descriptions are the reference documentation (``jobgen schema``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from jobgen.spec.fields import SpecModel

# Dotted paths of identifiers: TOML bare keys as the spec's tables spell them
# (field names, [env] variable names). No indices: a list is replaced whole. The same as
# jobgen.runs.sweep_files.DOTTED_KEY, which reads sweep.json with the standard library alone.
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

# Keys no point may set, with the reason the error gives. job.name and job.runs_root
# place the point's run directory (runs_root/<job.name>/points/<point>), which the sweep owns;
# the site is one for the whole array; a point cannot reshape the sweep that made it.
FORBIDDEN = {
    "site": "the site profile is one for the whole sweep",
    "sweep": "a point cannot change the sweep that makes it",
    "job.name": "job.name names the sweep; each point's run is named by its overrides",
    "job.runs_root": "each point's run directory is runs_root/<job.name>/points/<point>",
}

SEED_KEY = "train.seed"


def related_keys(key: str, other: str) -> bool:
    """One key is the other or lies under it (``job`` and ``job.name``)."""
    return key == other or key.startswith(other + ".") or other.startswith(key + ".")


def _sweep_key(key: str) -> str:
    """A dotted key a point may set; the error is reported on the key itself."""
    if not _DOTTED.fullmatch(key):
        raise ValueError(
            f"{key!r} is not a dotted key into run.toml such as 'train.lr' or 'model.lora.r' "
            "(letters, digits and '_' between the dots; a list is replaced whole, not indexed)"
        )
    for forbidden, why in FORBIDDEN.items():
        if related_keys(key, forbidden):
            raise ValueError(f"a sweep may not set {forbidden}: {why}")
    return key


SweepKey = Annotated[str, AfterValidator(_sweep_key)]


def _some_values(values: list[Any]) -> list[Any]:
    if not values:
        raise ValueError("an empty list: the cross product would have no points; give at least one value")
    return values


SweepValues = Annotated[list[Any], AfterValidator(_some_values)]


def overlapping_keys(keys: list[str]) -> tuple[str, str] | None:
    """Two keys of which one lies under the other: which wins would depend on their order."""
    for index, key in enumerate(keys):
        for other in keys[index + 1 :]:
            if related_keys(key, other):
                return key, other
    return None


class SweepSpec(SpecModel):
    """Many runs from this one file, submitted as one Slurm array. The points are the cross product
    of grid, then the tables of points, each repeated once per seed: at most 1000 (Slurm's default
    MaxArraySize), each validated as a run, no two the same run."""

    grid: dict[SweepKey, SweepValues] = Field(
        default_factory=dict,
        description=(
            'Dotted keys of this file (e.g. "train.lr", "model.lora.r", "data.max_length") to lists of '
            "values; the points are their cross product, the first key varying slowest, in the order written. "
            'Quote the keys: [sweep.grid] "train.lr" = [1e-4, 3e-4]. site, job.name, job.runs_root and '
            "sweep.* may not be swept, nor any key that changes what Slurm is asked for per task "
            "(job.nodes, job.time, ...): one array asks the same of every task."
        ),
    )
    points: list[dict[SweepKey, Any]] = Field(
        default_factory=list,
        description=(
            "Explicit points, after the grid's: each a table of dotted keys to values, e.g. "
            '[{ "train.lr" = 1e-3, "data.max_length" = 256 }]; {} is this file as written.'
        ),
    )
    max_parallel: int = Field(
        1,
        ge=1,
        description="Points running at once (the array's %K): the rest wait in the queue for a free slot.",
    )
    seeds: int | None = Field(
        None,
        ge=1,
        description=(
            "Repeat each point with this many seeds: train.seed is the file's train.seed (or its default) plus "
            "0, 1, ... N-1, and names the point's run. Not with train.seed among the swept keys."
        ),
    )

    @model_validator(mode="after")
    def _has_points(self) -> SweepSpec:
        if not self.grid and not self.points:
            raise ValueError(
                'a sweep needs at least one point: give [sweep.grid] ("train.lr" = [1e-4, 3e-4]) '
                'or sweep.points ([{ "train.lr" = 1e-3 }])'
            )
        return self

    @model_validator(mode="after")
    def _seeds_own_the_seed(self) -> SweepSpec:
        if self.seeds is None:
            return self
        if any(related_keys(key, SEED_KEY) for key in self.keys):
            raise ValueError(
                f"sweep.seeds sets {SEED_KEY} of every point (the file's seed + 0 .. {self.seeds - 1}): "
                f"sweep {SEED_KEY} itself or use sweep.seeds, not both"
            )
        return self

    @model_validator(mode="after")
    def _no_overlapping_keys(self) -> SweepSpec:
        for where, keys in [("sweep.grid", list(self.grid)), *self._point_keys()]:
            pair = overlapping_keys(keys)
            if pair:
                raise ValueError(
                    f"{where} sets both {pair[0]} and {pair[1]}, one inside the other: which one wins "
                    "would depend on their order; set the inner key only"
                )
        return self

    def _point_keys(self) -> list[tuple[str, list[str]]]:
        return [(f"sweep.points[{index}]", list(point)) for index, point in enumerate(self.points)]

    @property
    def keys(self) -> list[str]:
        """Every swept key, in the order first written (grid, then points), seed not included."""
        return list(dict.fromkeys([*self.grid, *(key for point in self.points for key in point)]))

    @property
    def size(self) -> int:
        """Number of points, seeds included, computed without expanding them."""
        grid = 1
        for values in self.grid.values():
            grid *= len(values)
        return ((grid if self.grid else 0) + len(self.points)) * (self.seeds or 1)
