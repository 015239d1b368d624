"""A run spec resolved against its site profile: :class:`ResolvedSpec`, what ``spec.json``
holds and what every other module takes. Apart from the loader (which builds it from the
TOML files) so that the trainer, the renderer and the watchdogs need only this type, not
the loading and error reporting around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobgen.spec.tables.run import RunSpec, layout_text
from jobgen.spec.tables.site import SiteProfile


def in_job_restarts(run: RunSpec, site: SiteProfile) -> int:
    """Relaunches inside one array task: the job's, else the site's (programs that relaunch only)."""
    if not run.job.kind.relaunches:
        return 0
    return run.job.in_job_restarts if run.job.in_job_restarts is not None else site.slurm.default_in_job_restarts


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
    def in_job_restarts(self) -> int:
        return in_job_restarts(self.run, self.site)

    # The world's shape: JobSpec.node_procs with the site's default, nowhere else.
    @property
    def default_procs_per_node(self) -> int:
        """Processes per node when job.procs_per_node is unset: the site's GPUs, else 1."""
        return self.site.slurm.default_procs_per_node

    @property
    def node_procs(self) -> tuple[int, ...]:
        """The processes on each node, in node order ($SLURM_NODEID)."""
        return self.run.job.node_procs(self.default_procs_per_node)

    @property
    def procs_per_node(self) -> int:
        """The most processes on one node (every node's, when they are equal): what each node's
        request (CPUs, memory, GPUs) must cover, since one allocation asks the same of every node."""
        return max(self.node_procs)

    @property
    def gpus_per_node(self) -> int:
        """The GPUs each node is asked for on a GPU site: one per process of the node with the most
        (a node's other GPUs would idle, and on a cluster whose nodes differ a request of the
        site's largest count fits only the largest nodes); 0 on a CPU site."""
        return self.procs_per_node if self.site.slurm.gpus_per_node else 0

    @property
    def world_size(self) -> int:
        return self.run.job.world_size(self.default_procs_per_node)

    @property
    def world_sizes(self) -> list[int]:
        """The world size of a task on each node count it may get (job.min_nodes to job.nodes)."""
        return [self.run.job.world_size(self.default_procs_per_node, n) for n in self.run.job.node_counts]

    @property
    def layout(self) -> str:
        """The world's shape in words: "2 node(s) x 2 process(es)", "2 nodes with 3 + 1 processes"."""
        return layout_text(self.node_procs)

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
