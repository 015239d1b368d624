"""The changes ``jobgen plan`` suggests for a run that does not fit, or fits tightly: each
candidate evaluated with the same estimate, headroom and verdict as the run itself
(:mod:`jobgen.memory_plan`), cheapest first, each with what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from jobgen.memory_estimate import PlanInputs, estimate, host_bytes_per_node, required_bytes
from jobgen.model_files import ModelInfo
from jobgen.sizes import format_bytes

# Over this fraction of the budget a run is "tight": the estimate's error (3-12 % on the runs
# measured so far, docs/large-models.md) is as large as what is left, so it may run or may not.
TIGHT_FRACTION = 0.90

OFFLOAD_COST = (
    "{host} of pinned host memory per node; slower steps: the optimizer runs on the CPU and every block is "
    "copied host→device each step (how much slower is not measured here)"
)
HSDP_COST = (
    "more memory per rank than FSDP over all nodes (each node holds a whole copy of the states), "
    "but the all-gathers stay within the node"
)


def verdict_for(required: int, budget: int, host: int = 0, host_budget: int | None = None) -> str:
    """ "fits", "tight" (over :data:`TIGHT_FRACTION` of the budget) or "does not fit" (over
    the device budget, or a node's host memory exceeded)."""
    if required > budget or (host_budget is not None and host > host_budget):
        return "does not fit"
    return "tight" if required > TIGHT_FRACTION * budget else "fits"


@dataclass
class Suggestion:
    change: str  # what to set, e.g. "train.optimizer_in_backward = true"
    cost: str  # what it costs
    peak: int
    fits: bool
    required: int = 0  # the peak plus the headroom
    verdict: str = ""
    host_per_node: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "change": self.change,
            "cost": self.cost,
            "peak_bytes": self.peak,
            "required_bytes": self.required,
            "verdict": self.verdict,
            "host_bytes_per_node": self.host_per_node,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Budgets:
    device: int
    host: int | None = None  # one node's host memory, None when the site does not say


class _Change:
    """One candidate change: its spec keys as text, what it costs, and the inputs it updates."""

    def __init__(self, label: str, cost: str, **updates: Any):
        self.label, self.cost, self.updates = label, cost, updates

    def __call__(self, inputs: PlanInputs) -> PlanInputs:
        return replace(inputs, **self.updates)


def _kept_batch(inputs: PlanInputs, world: int) -> tuple[int, int] | None:
    """(micro_batch_size, grad_accum) that keep the global batch on ``world`` ranks, the
    largest micro-batch first; None when no whole split does."""
    batch = inputs.micro_batch_size * inputs.grad_accum * inputs.world_size
    for mb in range(inputs.micro_batch_size, 0, -1):
        if batch % (mb * world) == 0:
            return mb, batch // (mb * world)
    return None


def _nodes_change(inputs: PlanInputs, factor: int, per_node: int) -> _Change:
    """More nodes with FSDP over all of them, keeping the global batch where a micro-batch and
    grad_accum do, and saying so where none does."""
    nodes, world = inputs.nodes * factor, inputs.nodes * factor * per_node
    keys = [f"job.nodes = {nodes}"] + ([] if inputs.parallelism == "fsdp" else ['train.parallelism = "fsdp"'])
    batch = inputs.micro_batch_size * inputs.grad_accum * inputs.world_size
    kept = _kept_batch(inputs, world)
    if kept is None:
        mb, accum = 1, 1
        cost = (
            f"{factor}x the nodes; the global batch grows from {batch} to {world} sequences (no micro-batch "
            f"and grad_accum keep {batch} on {world} ranks): the learning rate was tuned for the other"
        )
    else:
        mb, accum = kept
        cost = f"{factor}x the nodes, the same global batch ({batch})"
        if mb != inputs.micro_batch_size:
            keys.append(f"train.micro_batch_size = {mb}")
        if accum != inputs.grad_accum and inputs.global_batch_size is None:
            keys.append(f"train.grad_accum = {accum}")  # with global_batch_size it follows by itself
    updates = dict(nodes=nodes, world_size=world, parallelism="fsdp", micro_batch_size=mb, grad_accum=accum)
    return _Change(", ".join(keys), cost, **updates)


def _parallelism_changes(inputs: PlanInputs) -> list[_Change]:
    out = []
    if inputs.parallelism == "ddp" and inputs.world_size > 1:
        # Unequal nodes have no default shard group (a node): hsdp would need a train.shard_size too.
        if inputs.nodes > 1 and not inputs.node_procs:
            out.append(_Change('train.parallelism = "hsdp"', HSDP_COST, parallelism="hsdp"))
        across = ", each block all-gathered across the network twice a step" if inputs.nodes > 1 else ""
        out.append(_Change('train.parallelism = "fsdp"', f"more communication{across}", parallelism="fsdp"))
    if inputs.parallelism == "hsdp" and inputs.shard < inputs.world_size:
        cost = "shards over every rank: each block all-gathered across the network twice a step"
        label = 'train.parallelism = "fsdp"' + (" (without train.shard_size)" if inputs.shard_size else "")
        out.append(_Change(label, cost, parallelism="fsdp", shard_size=None))
    return out


def _offload_change(inputs: PlanInputs) -> list[_Change]:
    if inputs.device != "cuda" or inputs.cpu_offload:
        return []
    fsdp = ', train.parallelism = "fsdp"' if inputs.parallelism == "ddp" else ""
    parallelism = "fsdp" if inputs.parallelism == "ddp" else inputs.parallelism
    return [_Change(f"train.cpu_offload = true{fsdp}", OFFLOAD_COST, cpu_offload=True, parallelism=parallelism)]


def _candidates(inputs: PlanInputs, procs_per_node: int) -> list[_Change]:
    """Candidate changes, cheapest first."""
    out = []
    if not inputs.optimizer_in_backward and inputs.grad_accum == 1:
        out.append(
            _Change("train.optimizer_in_backward = true", "no extra compute; no gradient accumulation",
                    optimizer_in_backward=True)
        )  # fmt: skip
    if not inputs.loss_chunk_tokens:
        out.append(_Change("train.loss_chunk_tokens = 1024", "a little compute", loss_chunk_tokens=1024))
    out += _parallelism_changes(inputs)
    if inputs.device == "cuda" and not inputs.activation_offloading:
        both = "" if inputs.gradient_checkpointing else ", model.gradient_checkpointing = true"
        out.append(
            _Change(f"model.activation_offloading = true{both}", "about 1% slower (plus recompute)",
                    activation_offloading=True, gradient_checkpointing=True)
        )  # fmt: skip
    if not inputs.gradient_checkpointing:
        out.append(
            _Change("model.gradient_checkpointing = true", "about 30% more compute", gradient_checkpointing=True)
        )
    if inputs.optimizer == "adamw":
        out.append(_Change('train.optimizer = "adafactor"', "factored second moment", optimizer="adafactor"))
    mb = inputs.micro_batch_size
    while mb > 1:
        mb //= 2
        accum = inputs.grad_accum * (inputs.micro_batch_size // mb)
        out.append(
            _Change(f"train.micro_batch_size = {mb}, train.grad_accum = {accum}", "same batch, lower throughput",
                    micro_batch_size=mb, grad_accum=accum)
        )  # fmt: skip
    out += _offload_change(inputs)
    if not inputs.node_procs:  # unequal nodes: which machines more nodes would be is not known
        out += [_nodes_change(inputs, factor, max(1, procs_per_node)) for factor in (2, 4, 8, 16)]
    length = inputs.seq_len
    while length > 256:
        length //= 2
        out.append(_Change(f"data.max_length = {length}", "shorter rows: changes what is learned", seq_len=length))
    return out


def evaluate(model: ModelInfo, inputs: PlanInputs, budgets: Budgets) -> tuple[int, int, int, str]:
    """(peak, required, host bytes per node, verdict) of ``inputs``."""
    est = estimate(model, inputs)
    required, host = required_bytes(est, inputs), host_bytes_per_node(est, inputs)
    return est.peak, required, host, verdict_for(required, budgets.device, host, budgets.host)


def _suggestion(model: ModelInfo, change: _Change, inputs: PlanInputs, budgets: Budgets) -> Suggestion:
    peak, required, host, verdict = evaluate(model, change(inputs), budgets)
    cost = change.cost.replace("{host}", format_bytes(host))
    return Suggestion(change.label, cost, peak, verdict != "does not fit", required, verdict, host)


def _first_of_groups(found: list[Suggestion]) -> list[Suggestion]:
    """Of the node counts and of the max_lengths, only the smallest change that fits with room,
    else the smallest that fits tightly."""
    for group in ("job.nodes", "data.max_length"):
        members = [s for s in found if s.change.startswith(group)]
        best = next((s for s in members if s.verdict == "fits"), members[0] if members else None)
        found = [s for s in found if not s.change.startswith(group) or s is best]
    return found


def suggestions(model: ModelInfo, inputs: PlanInputs, budgets: Budgets, procs_per_node: int, *, tight: bool = False):
    """Each candidate change evaluated with the same estimator; those that make the run fit
    (for a ``tight`` run: fit with room), cheapest first (of the node counts and max_lengths
    only the first). When no single change does, the candidates applied together in order until
    the run fits, as one suggestion."""
    wanted = ("fits",) if tight else ("fits", "tight")
    found = []
    for change in _candidates(inputs, procs_per_node):
        suggestion = _suggestion(model, change, inputs, budgets)
        if suggestion.verdict in wanted:
            found.append(suggestion)
    if found:
        return _first_of_groups(found)
    for goal in wanted:
        combined = _combined(model, inputs, budgets, procs_per_node, goal)
        if combined:
            return combined
    return []


def _combined(model: ModelInfo, inputs: PlanInputs, budgets: Budgets, procs_per_node: int, goal: str):
    """The candidates (but node counts, lengths and micro-batches) applied together in order
    until the verdict is ``goal`` or better, then each one that is not needed after all dropped."""
    good = ("fits",) if goal == "fits" else ("fits", "tight")
    steps: list[_Change] = []
    current = inputs
    for change in _candidates(inputs, procs_per_node):
        if change.label.startswith(("job.nodes", "data.max_length", "train.micro_batch_size")):
            continue
        changed = change(current)
        if changed == current:
            continue
        steps.append(change)
        current = changed
        if evaluate(model, current, budgets)[3] in good:
            break
    else:
        return []
    for item in list(reversed(steps)):
        trial = [s for s in steps if s is not item]
        if evaluate(model, _apply(inputs, trial), budgets)[3] in good:
            steps = trial
    final = _apply(inputs, steps)
    peak, required, host, verdict = evaluate(model, final, budgets)
    costs = "; ".join(s.cost.replace("{host}", format_bytes(host)) for s in steps if "{host}" in s.cost)
    cost = "all of these together" + (f" ({costs})" if costs else "")
    return [Suggestion("; ".join(s.label for s in steps), cost, peak, True, required, verdict, host)]


def _apply(inputs: PlanInputs, steps: list[_Change]) -> PlanInputs:
    for change in steps:
        inputs = change(inputs)
    return inputs
