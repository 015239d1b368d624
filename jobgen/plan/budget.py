"""The memory a rank must fit (``jobgen plan``'s budget): the site's slurm.device_memory, or
each node's (job.device_memory: every rank fits the smallest, and a pipeline's positions each
their own nodes'), or on CPU sites a node's slurm.mem shared by its processes; and the host
memory of a node, for what a GPU run pins there."""

from __future__ import annotations

from typing import Any

from jobgen.base.sizes import parse_size
from jobgen.plan.inputs import PlanInputs
from jobgen.plan.pipeline import PositionEstimate, position_budgets


def _node_memory(mem: str | None) -> int | None:
    """Bytes of a Slurm --mem (MiB without a unit); None for unset or '0' (a whole node)."""
    if not mem or mem == "0":
        return None
    return parse_size(mem if mem[-1].isalpha() else mem + "M")


def budget_for(spec: Any) -> tuple[int | None, str]:
    """Memory one rank may use: site slurm.device_memory, else on CPU sites slurm.mem divided
    by the processes per node; (None, why) when neither says."""
    slurm = spec.site.slurm
    per_node = spec.run.job.node_memory()
    if per_node:  # every rank must fit the smallest (a pipeline's positions: position_budgets)
        return min(per_node), f"job.device_memory, its smallest of {', '.join(spec.run.job.device_memory)}"
    given = getattr(slurm, "device_memory", None)
    if given:
        return parse_size(given), f"slurm.device_memory = {given}"
    per_node = _node_memory(slurm.mem)
    if not slurm.computes_on_gpu and per_node:
        # With unequal nodes, the node with the most processes has the least memory for each.
        most = "the most on one node" if spec.run.job.unequal_nodes else "per node"
        return per_node // max(1, spec.procs_per_node), f"slurm.mem {slurm.mem} / {spec.procs_per_node} {most}"
    return None, "no slurm.device_memory in the site"


def tightest_position(
    positions: list[PositionEstimate], inputs: PlanInputs
) -> tuple[PositionEstimate, list[int]] | None:
    """With job.device_memory, a pipeline's verdict is about the position nearest its own
    budget (the least memory of its nodes), not the busiest: a 24 GB card holding fewer blocks
    may still be tighter than an 80 GB one holding more. (That position, every position's
    budget); None without per-node memory or a pipeline."""
    budgets = position_budgets(inputs) if positions else None
    if budgets is None:
        return None
    return max(positions, key=lambda p: p.estimate.peak / max(1, budgets[p.position])), budgets


def host_budget_for(spec: Any) -> tuple[int | None, str]:
    """A node's host memory, for what a GPU run pins there: site slurm.mem; (None, why) when
    the job takes a whole node ('0') or the site does not say."""
    mem = spec.site.slurm.mem
    per_node = _node_memory(mem)
    if per_node:
        return per_node, f"slurm.mem = {mem}"
    what = "slurm.mem = 0 (a whole node, of a size the site does not say)" if mem == "0" else "no slurm.mem"
    return None, f"{what}: check that the nodes have it"
