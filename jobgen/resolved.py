"""A run spec resolved against its site profile: :class:`ResolvedSpec`, what ``spec.json``
holds and what every other module takes. Apart from the loader (which builds it from the
TOML files) so that the trainer, the renderer and the watchdogs need only this type, not
the loading and error reporting around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobgen.site import SiteProfile
from jobgen.spec import RunSpec


@dataclass(frozen=True)
class ResolvedSpec:
    """A validated run plus its site profile, with every derived value in one place."""

    run: RunSpec
    site: SiteProfile
    spec_file: str | None
    site_file: str | None

    # Job keys override site keys; these are the values the job really gets.
    @property
    def partition(self) -> str | None:
        return self.run.job.partition or self.site.slurm.partition

    @property
    def account(self) -> str | None:
        return self.run.job.account or self.site.slurm.account

    @property
    def qos(self) -> str | None:
        return self.run.job.qos or self.site.slurm.qos

    @property
    def constraint(self) -> str | None:
        return self.run.job.constraint or self.site.slurm.constraint

    @property
    def procs_per_node(self) -> int:
        if self.run.job.procs_per_node is not None:
            return self.run.job.procs_per_node
        return self.site.slurm.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.run.job.nodes * self.procs_per_node

    @property
    def runs_root(self) -> Path:
        return Path(self.run.job.runs_root or self.site.paths.runs_root)

    @property
    def run_dir(self) -> Path:
        return self.runs_root / self.run.job.name

    def to_json(self) -> dict[str, Any]:
        return {
            "spec_file": self.spec_file,
            "site_file": self.site_file,
            "site": self.site.model_dump(mode="json"),
            "run": self.run.model_dump(mode="json"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResolvedSpec:
        return cls(
            run=RunSpec.model_validate(data["run"]),
            site=SiteProfile.model_validate(data["site"]),
            spec_file=data.get("spec_file"),
            site_file=data.get("site_file"),
        )
