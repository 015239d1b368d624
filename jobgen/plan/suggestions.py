"""The changes ``jobgen plan`` suggests for a run that does not fit, or fits tightly: each
candidate evaluated with the same estimate, headroom and verdict as the run itself
(:mod:`jobgen.plan.memory_plan`), cheapest first, each with what it costs.

On an Ethernet site (``network.transport = "socket"``) a pipeline is among the candidates, and
:func:`network_suggestions` offers it whatever the verdict to a run of several nodes that
shards or replicates over the network (ddp, fsdp, hsdp): only activations cross the network
between the pipeline's positions. Candidates a pipeline refuses (train.optimizer_in_backward,
train.cpu_offload...) or whose layout cannot run are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from jobgen.base.sizes import format_bytes
from jobgen.model.files import ModelInfo
from jobgen.model.mesh import context_parallel_problem
from jobgen.model.parallelism import STRATEGIES, Parallelism
from jobgen.plan.estimate import host_bytes_per_node, required_bytes
from jobgen.plan.inputs import PipelineInputs, PlanInputs
from jobgen.plan.pipeline import estimate_run, pipeline_problem

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
PIPELINE_LABEL = 'train.parallelism = "pipeline"'
# What more nodes, and CPU offload from whole copies, shard over: every rank.
SPREAD = "fsdp"


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


def _global_batch(inputs: PlanInputs) -> int:
    """Sequences per optimizer step: a micro-batch x grad_accum on each data-parallel replica
    (every rank, or every pipeline)."""
    return inputs.micro_batch_size * inputs.grad_accum * inputs.mesh.data_replicas


def _kept_batch(inputs: PlanInputs, world: int) -> tuple[int, int] | None:
    """(micro_batch_size, grad_accum) that keep the global batch on ``world`` ranks without a
    pipeline (the context-parallel groups kept), the largest micro-batch first; None when no
    whole split does."""
    batch = _global_batch(inputs)
    replicas = max(1, world // inputs.mesh.cp)
    for mb in range(inputs.micro_batch_size, 0, -1):
        if batch % (mb * replicas) == 0:
            return mb, batch // (mb * replicas)
    return None


def _nodes_change(inputs: PlanInputs, factor: int, per_node: int) -> _Change:
    """More nodes with FSDP over all of them, keeping the global batch where a micro-batch and
    grad_accum do, and saying so where none does."""
    nodes, world = inputs.nodes * factor, inputs.nodes * factor * per_node
    fsdp = f'train.parallelism = "{SPREAD}"' + (" (without [train.pipeline])" if inputs.strategy.pipelined else "")
    keys = [f"job.nodes = {nodes}"] + ([] if inputs.parallelism == SPREAD else [fsdp])
    batch = _global_batch(inputs)
    kept = _kept_batch(inputs, world)
    if kept is None:
        mb, accum = 1, 1
        grown = max(1, world // inputs.mesh.cp)  # one sequence per data-parallel replica
        cost = (
            f"{factor}x the nodes; the global batch grows from {batch} to {grown} sequences (no micro-batch "
            f"and grad_accum keep {batch} on {world} ranks): the learning rate was tuned for the other"
        )
        if inputs.global_batch_size is not None:  # pinned by the spec: the change must say it grows
            keys.append(f"train.global_batch_size = {grown}")
        if inputs.micro_batch_size != 1:
            keys.append("train.micro_batch_size = 1")
    else:
        mb, accum = kept
        cost = f"{factor}x the nodes, the same global batch ({batch})"
        if mb != inputs.micro_batch_size:
            keys.append(f"train.micro_batch_size = {mb}")
        if accum != inputs.grad_accum and inputs.global_batch_size is None:
            keys.append(f"train.grad_accum = {accum}")  # with global_batch_size it follows by itself
    updates = dict(
        nodes=nodes, world_size=world, parallelism=SPREAD, micro_batch_size=mb, grad_accum=accum, pipeline=None
    )
    return _Change(", ".join(keys), cost, **updates)


def _parallelism_changes(inputs: PlanInputs) -> list[_Change]:
    """The strategies the run's entry names ``instead`` (jobgen.model.parallelism), on several
    ranks: one that shards within a node only on several nodes of the same size (unequal nodes
    have no default shard group: it would need a train.shard_size too), one that shards over
    every rank from one that shards within a node only while that is not every rank already."""
    current, out = inputs.strategy, []
    for name in current.instead if inputs.world_size > 1 else ():
        target = STRATEGIES[name]
        if target.groups_by_node and (inputs.nodes < 2 or inputs.node_procs):
            continue
        if current.groups_by_node and inputs.shard >= inputs.world_size:
            continue
        label = f'train.parallelism = "{name}"' + (" (without train.shard_size)" if inputs.shard_size else "")
        out.append(_Change(label, _instead_cost(current, target, inputs), parallelism=name, shard_size=None))
    return out


def _instead_cost(current: Parallelism, target: Parallelism, inputs: PlanInputs) -> str:
    if target.groups_by_node:
        return HSDP_COST
    if current.groups_by_node:
        return "shards over every rank: each block all-gathered across the network twice a step"
    across = ", each block all-gathered across the network twice a step" if inputs.nodes > 1 else ""
    return f"more communication{across}"


def _pipeline_change(inputs: PlanInputs) -> _Change | None:
    """``train.parallelism = "pipeline"`` for a data-parallel run of several ranks: one position
    per node (the node's ranks its replicas, sharded over them by FSDP), or one pipeline over every
    rank on one node or unequal nodes; the global batch kept (grad_accum x positions, all of
    a step's micro-batches in one schedule step); 1f1b when a micro-batch splits into at
    least a piece per position (one row each, the default), else gpipe."""
    if inputs.strategy.pipelined or inputs.world_size < 2:
        return None
    per_node = inputs.nodes > 1 and not inputs.node_procs and inputs.world_size % inputs.nodes == 0
    pp = inputs.nodes if per_node else inputs.world_size
    schedule = "1f1b" if inputs.micro_batch_size >= pp else "gpipe"
    keys = [PIPELINE_LABEL + (" (without train.shard_size)" if inputs.shard_size else "")]
    keys += [f"train.pipeline.size = {pp}"] if per_node else []
    keys += [] if schedule == "1f1b" else ['train.pipeline.schedule = "gpipe"']
    accum = inputs.grad_accum * pp
    if inputs.global_batch_size is None:
        keys.append(f"train.grad_accum = {accum}")
    pieces = inputs.micro_batch_size * accum
    where = "only activations cross the network" if inputs.nodes > 1 else "only activations pass between ranks"
    bubble = (pp - 1) / (pieces + pp - 1)
    cost = f"{where}; a pipeline bubble of about {bubble:.0%} of the step ({pp} positions, {pieces} pieces a step)"
    pipeline = PipelineInputs(size=pp if per_node else None, schedule=schedule)
    return _Change(", ".join(keys), cost, parallelism="pipeline", pipeline=pipeline, grad_accum=accum, shard_size=None)


def _pipeline_run_changes(inputs: PlanInputs) -> list[_Change]:
    """For a pipeline: its replicas sharded instead of whole, and 1f1b instead of gpipe."""
    pipe = inputs.pipeline
    if not inputs.strategy.pipelined or pipe is None:
        return []
    out = []
    whole_replicas = not STRATEGIES[pipe.data_parallel].shards_parameters
    if whole_replicas and inputs.world_size > (pipe.size or inputs.world_size):
        cost = "the replicas gather each stage's parameters (within their group) every step"
        out.append(_Change('train.pipeline.data_parallel = "fsdp"', cost, pipeline=replace(pipe, data_parallel="fsdp")))
    if pipe.schedule == "gpipe":
        cost = "position p holds the activations of at most pp - p pieces instead of all of them; the same bubble"
        out.append(_Change('train.pipeline.schedule = "1f1b"', cost, pipeline=replace(pipe, schedule="1f1b")))
    return out


def _offload_change(inputs: PlanInputs) -> list[_Change]:
    if inputs.device != "cuda" or inputs.cpu_offload:
        return []
    # FSDP2 offloads its shards: a strategy that keeps whole copies moves to sharding over every rank.
    whole = not inputs.strategy.shards_parameters
    fsdp = f', train.parallelism = "{SPREAD}"' if whole else ""
    parallelism = SPREAD if whole else inputs.parallelism
    return [_Change(f"train.cpu_offload = true{fsdp}", OFFLOAD_COST, cpu_offload=True, parallelism=parallelism)]


def _expert_parallel_changes(model: ModelInfo, inputs: PlanInputs) -> list[_Change]:
    """For a mixture of experts under a strategy that splits experts: each MoE layer's experts
    over K ranks of a node (K dividing the experts and the world; the all-to-all stays on the
    node's links), the fewest first."""
    moe = model.moe
    if moe is None or not inputs.strategy.expert_parallel or inputs.expert_parallel > 1:
        return []
    out = []
    for degree in range(2, min(moe.experts, inputs.ranks_per_node) + 1):
        if moe.experts % degree or inputs.world_size % degree:
            continue
        cost = (
            f"each MoE layer's routed tokens cross an all-to-all twice forward and twice backward; FSDP gathers "
            f"{moe.experts // degree} of its {moe.experts} experts instead of all"
        )
        out.append(_Change(f"train.expert_parallel = {degree}", cost, expert_parallel=degree))
    return out


def _candidates(inputs: PlanInputs, procs_per_node: int, model: ModelInfo | None = None) -> list[_Change]:
    """Candidate changes, cheapest first; a pipeline among them on an Ethernet site. Some may
    be what the spec refuses (:func:`_runs` leaves them out)."""
    out = _pipeline_run_changes(inputs)
    out += _expert_parallel_changes(model, inputs) if model is not None else []
    # The spec refuses optimizer_in_backward with accumulation, a global batch (its grad_accum
    # follows the world) and clipping by the global norm (no moment holds every gradient).
    in_backward_refused = inputs.grad_accum > 1 or inputs.global_batch_size is not None or inputs.global_clip
    if not inputs.optimizer_in_backward and not in_backward_refused:
        out.append(
            _Change("train.optimizer_in_backward = true", "no extra compute; no gradient accumulation",
                    optimizer_in_backward=True)
        )  # fmt: skip
    if not inputs.loss_chunk_tokens:
        out.append(_Change("train.loss_chunk_tokens = 1024", "a little compute", loss_chunk_tokens=1024))
    out += _parallelism_changes(inputs)
    change = _pipeline_change(inputs) if inputs.nccl.transport == "socket" else None
    out += [change] if change else []
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


def evaluate(model: ModelInfo, inputs: PlanInputs, budgets: Budgets | None) -> tuple[int, int, int, str]:
    """(peak, required, host bytes per node, verdict) of ``inputs`` (verdict "no budget"
    without ``budgets``)."""
    est = estimate_run(model, inputs)
    required, host = required_bytes(est, inputs), host_bytes_per_node(est, inputs)
    if budgets is None:
        return est.peak, required, host, "no budget"
    return est.peak, required, host, verdict_for(required, budgets.device, host, budgets.host)


def _runs(model: ModelInfo, inputs: PlanInputs, held: frozenset[str], *, may_move: bool = False) -> bool:
    """Whether the spec and the trainer would run ``inputs`` at all: nothing its parallelism's
    entry or its context-parallel degree refuses of the settings it has on and ``held`` (what
    the run has on besides: [eval]; a change only turns settings on), and a pipeline that can
    be laid out on the model. ``may_move``: a step of a combination, which a later step may
    take to one of the strategies its entry names ``instead`` (ddp's refusals are lifted by fsdp)."""
    on = inputs.turned_on() | held
    if context_parallel_problem(inputs.strategy, inputs.mesh.cp, on):
        return False
    if inputs.expert_parallel > 1 and not inputs.strategy.expert_parallel:
        return False
    if inputs.strategy.refusal(on) and not (may_move and inputs.strategy.instead):
        return False
    return not inputs.strategy.pipelined or pipeline_problem(model, inputs, held) is None


def _suggestion(model: ModelInfo, change: _Change, inputs: PlanInputs, budgets: Budgets | None) -> Suggestion:
    peak, required, host, verdict = evaluate(model, change(inputs), budgets)
    cost = change.cost.replace("{host}", format_bytes(host))
    return Suggestion(change.label, cost, peak, verdict in ("fits", "tight"), required, verdict, host)


def _first_of_groups(found: list[Suggestion]) -> list[Suggestion]:
    """Of the node counts and of the max_lengths, only the smallest change that fits with room,
    else the smallest that fits tightly."""
    for group in ("job.nodes", "data.max_length"):
        members = [s for s in found if s.change.startswith(group)]
        best = next((s for s in members if s.verdict == "fits"), members[0] if members else None)
        found = [s for s in found if not s.change.startswith(group) or s is best]
    return found


def suggestions(
    model: ModelInfo,
    inputs: PlanInputs,
    budgets: Budgets,
    procs_per_node: int,
    *,
    tight: bool = False,
    held: frozenset[str] = frozenset(),
):
    """Each candidate change evaluated with the same estimator; those that make the run fit
    (for a ``tight`` run: fit with room), cheapest first (of the node counts and max_lengths
    only the first). When no single change does, the candidates applied together in order until
    the run fits, as one suggestion. ``held``: what the run has on that the inputs do not hold
    (RunSpec.turned_on), so that nothing is suggested that the spec would refuse."""
    wanted = ("fits",) if tight else ("fits", "tight")
    found = []
    for change in _candidates(inputs, procs_per_node, model):
        if not _runs(model, change(inputs), held):
            continue
        suggestion = _suggestion(model, change, inputs, budgets)
        if suggestion.verdict in wanted:
            found.append(suggestion)
    if found:
        return _first_of_groups(found)
    for goal in wanted:
        combined = _combined(model, inputs, budgets, procs_per_node, goal, held)
        if combined:
            return combined
    return []


def _combined(
    model: ModelInfo, inputs: PlanInputs, budgets: Budgets, procs_per_node: int, goal: str, held: frozenset[str]
):
    """The candidates (but node counts, lengths, micro-batches and a pipeline) applied together
    in order until the verdict is ``goal`` or better, then each one that is not needed after all
    dropped; nothing when what is left is what the spec refuses."""
    good = ("fits",) if goal == "fits" else ("fits", "tight")
    steps: list[_Change] = []
    current = inputs
    for change in _candidates(inputs, procs_per_node, model):
        if change.label.startswith(("job.nodes", "data.max_length", "train.micro_batch_size", PIPELINE_LABEL)):
            continue
        changed = change(current)
        if changed == current or not _runs(model, changed, held, may_move=True):
            continue
        steps.append(change)
        current = changed
        if evaluate(model, current, budgets)[3] in good:
            break
    else:
        return []
    for item in list(reversed(steps)):
        trial = [s for s in steps if s is not item]
        if _runs(model, _apply(inputs, trial), held) and evaluate(model, _apply(inputs, trial), budgets)[3] in good:
            steps = trial
    final = _apply(inputs, steps)
    if not _runs(model, final, held):
        return []
    peak, required, host, verdict = evaluate(model, final, budgets)
    costs = "; ".join(s.cost.replace("{host}", format_bytes(host)) for s in steps if "{host}" in s.cost)
    cost = "all of these together" + (f" ({costs})" if costs else "")
    return [Suggestion("; ".join(s.label for s in steps), cost, peak, True, required, verdict, host)]


def _apply(inputs: PlanInputs, steps: list[_Change]) -> PlanInputs:
    for change in steps:
        inputs = change(inputs)
    return inputs


def network_suggestions(
    model: ModelInfo, inputs: PlanInputs, budgets: Budgets | None, *, held: frozenset[str] = frozenset()
) -> list[Suggestion]:
    """On an Ethernet site, for a run of several nodes whose parallelism moves parameters or
    gradients over the network every step (ddp, fsdp, hsdp): the pipeline (:func:`_pipeline_change`)
    with its memory (the busiest position's peak), whatever the run's verdict; nothing when the
    spec or the trainer would refuse it (``held``: as :func:`suggestions` takes it)."""
    if inputs.nccl.transport != "socket" or inputs.nodes < 2:
        return []
    change = _pipeline_change(inputs)
    if change is None or not _runs(model, change(inputs), held):
        return []
    return [_suggestion(model, change, inputs, budgets)]
