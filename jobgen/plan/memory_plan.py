"""The memory plan of a run, before it is queued (``jobgen plan`` and submit's check): the
estimate for its resolved spec, the budget it must fit, the verdict, and the changes that
would make it fit, each evaluated with the same estimator (:mod:`jobgen.plan.estimate`).

A pipeline (``train.parallelism = "pipeline"``) is estimated per position
(:mod:`jobgen.plan.pipeline`): the busiest position's figures are the rank's, and the
table lists every position's. On an Ethernet site a run of several nodes that shards or
replicates over the network is shown the pipeline, with its memory and what it costs
(:func:`jobgen.plan.suggestions.network_suggestions`), whatever its verdict.

The verdict compares what a rank requires, the predicted peak plus the headroom a GPU needs
beyond it (NCCL's buffers, the CUDA context, the allocator's fragmentation:
:func:`jobgen.plan.estimate.headroom`), with the budget: "fits" up to 90 % of it, "tight"
above (the estimate is not that exact: it may run, it may not), "does not fit" above 100 %
or when cpu_offload's pinned host memory exceeds a node's (site slurm.mem).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobgen.base.safe_read import DamagedFile, read_json
from jobgen.base.sizes import MIB, format_bytes
from jobgen.model.files import ModelFileError, ModelInfo, PlanError, UnsizedModel, read_model
from jobgen.model.lora_targets import adapted, weight_modules
from jobgen.model.parallelism import STRATEGIES
from jobgen.plan.budget import budget_for, host_budget_for, tightest_position
from jobgen.plan.context_parallel import share_of_row
from jobgen.plan.estimate import FRAGMENTATION_MARGIN, headroom, host_bytes_per_node
from jobgen.plan.inputs import PipelineInputs, PlanInputs
from jobgen.plan.nccl import settings_from
from jobgen.plan.pipeline import (
    Layout,
    PipelineEstimate,
    PipelineLayoutError,
    PositionEstimate,
    estimate_run,
)
from jobgen.plan.suggestions import (
    TIGHT_FRACTION,
    Budgets,
    Suggestion,
    network_suggestions,
    suggestions,
    verdict_for,
)
from jobgen.spec.global_batch import GlobalBatchError, grad_accum_for

COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations", "logits", "buffers", "overhead")
PHASES = ("load", "first_step", "steady")
HEADROOM_LABELS = {
    "nccl_buffers": "NCCL buffers",
    "cuda_context": "CUDA context",
    "fragmentation": f"fragmentation {FRAGMENTATION_MARGIN:.0%}",
}


@dataclass
class MemoryPlan:
    """A run's per-device prediction, its budget and verdict, and what would make it fit."""

    model_path: str
    device: str
    world_size: int
    inputs: PlanInputs | None = None
    components: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    reserve: int = 0  # the sum of ``headroom``
    budget: int | None = None
    budget_source: str = ""
    suggestions: list[Suggestion] = field(default_factory=list)
    host_offload_bytes: int = 0
    param_count: int = 0
    param_source: str = ""  # "safetensors" (the headers) or "config.json" (its dimensions)
    trainable_params: int = 0
    unavailable: str | None = None  # why no estimate could be made
    notes: list[str] = field(default_factory=list)
    measured: dict[str, Any] | None = None  # memory_peaks of an earlier job of the run
    headroom: dict[str, int] = field(default_factory=dict)  # beyond the peak: NCCL, CUDA context, fragmentation
    host_per_node: int = 0  # pinned host memory of a node's ranks (cpu_offload, offloaded activations)
    host_budget: int | None = None  # a node's host memory (site slurm.mem), None when unknown
    host_budget_source: str = ""
    pipeline: Layout | None = None  # a pipeline's layout, and each position's estimate
    positions: list[PositionEstimate] = field(default_factory=list)
    # job.device_memory: each position's budget (its nodes' least) and the tightest position,
    # whose figures and budget the verdict is about; None otherwise (the busiest's figures).
    position_budgets: list[int] | None = None
    tightest: int | None = None
    network_suggestions: list[Suggestion] = field(default_factory=list)  # Ethernet: a pipeline, whatever the verdict

    @property
    def required(self) -> int:
        """The peak plus what the verdict reserves beyond the predicted figure."""
        return self.peak + self.reserve

    @property
    def verdict(self) -> str:
        if self.unavailable:
            return "cannot estimate"
        if self.budget is None:
            return "no budget"
        return verdict_for(self.required, self.budget, self.host_per_node, self.host_budget)

    @property
    def fits(self) -> bool | None:
        """False for "does not fit" (what submit refuses), True for "fits" and "tight"."""
        if self.unavailable or self.budget is None:
            return None
        return self.verdict != "does not fit"

    @property
    def tight(self) -> bool:
        return self.verdict == "tight"

    @property
    def host_exceeded(self) -> bool:
        return self.host_budget is not None and self.host_per_node > self.host_budget

    def to_json(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "device": self.device,
            "world_size": self.world_size,
            "param_count": self.param_count,
            "param_source": self.param_source,
            "trainable_params": self.trainable_params,
            "components": dict(self.components),
            "phases": dict(self.phases),
            "peak_bytes": self.peak,
            "headroom": dict(self.headroom),
            "reserve_bytes": self.reserve,
            "required_bytes": self.required if not self.unavailable else None,
            "budget_bytes": self.budget,
            "budget_source": self.budget_source,
            "tight_fraction": TIGHT_FRACTION,
            "verdict": self.verdict,
            "fits": self.fits,
            "host_offload_bytes": self.host_offload_bytes,
            "host_bytes_per_node": self.host_per_node,
            "host_budget_bytes": self.host_budget,
            "host_budget_source": self.host_budget_source,
            "suggestions": [s.to_json() for s in self.suggestions],
            "network_suggestions": [s.to_json() for s in self.network_suggestions],
            "pipeline": self._pipeline_json(),
            "unavailable": self.unavailable,
            "notes": list(self.notes),
            "inputs": asdict(self.inputs) if self.inputs else None,
            "measured": self.measured,
        }

    def _pipeline_json(self) -> dict[str, Any] | None:
        if self.pipeline is None:
            return None
        layout = self.pipeline
        return {
            "positions": layout.pp,
            "replicas": layout.dp,
            "stages": len(layout.ranges),
            "schedule": layout.schedule,
            "pieces": layout.pieces,
            "rows_per_piece": layout.rows,
            "per_position": [p.to_json() for p in self.positions],
        }

    def _pipeline_lines(self) -> list[str]:
        """Every position's peak and what it holds, the busiest marked (its figures are above)."""
        if self.pipeline is None:
            return []
        busiest = max(self.positions, key=lambda p: p.estimate.peak).position
        lines = ["per pipeline position (peak; what it holds):"]
        for p in self.positions:
            if self.tightest is not None and self.position_budgets is not None:
                share = p.estimate.peak / max(1, self.position_budgets[p.position])
                budget = f" [{share:.0%} of its nodes' {format_bytes(self.position_budgets[p.position])}]"
                mark = "  <- the tightest: the figures above" if p.position == self.tightest else ""
            else:
                budget, mark = "", "  <- the busiest: the figures above" if p.position == busiest else ""
            lines.append(f"  {p.line(self.pipeline.pieces)}{budget}{mark}")
        return lines

    def _network_lines(self) -> list[str]:
        """Ethernet's suggestions not already among the changes that would make the run fit."""
        shown = {s.change for s in self.suggestions if s.fits} if (self.fits is False or self.tight) else set()
        extra = [s for s in self.network_suggestions if s.change not in shown]
        if not extra:
            return []
        where = "GPU" if self.device == "cuda" else "rank"
        lines = ["on Ethernet between nodes (site network.transport = 'socket'), consider:"]
        for s in extra:
            verdict = f", {s.verdict}" if s.verdict != "no budget" else ""
            lines.append(
                f"  {s.change}  -> {format_bytes(s.required)} per {where}, the busiest position{verdict} ({s.cost})"
            )
        return lines

    def _host_clause(self) -> str:
        if not self.host_per_node:
            return ""
        clause = f"; host memory {format_bytes(self.host_per_node)} per node (pinned)"
        if self.host_budget is None:
            return clause + f", {self.host_budget_source}"
        return clause + f" of {format_bytes(self.host_budget)} ({self.host_budget_source})"

    def summary(self) -> str:
        """One line: the verdict with its numbers."""
        if self.unavailable:
            return f"memory plan: cannot estimate: {self.unavailable}"
        where = "GPU" if self.device == "cuda" else "rank (host memory)"
        head = f"memory plan: {format_bytes(self.peak)} per {where}"
        if self.reserve:
            head += f" + {format_bytes(self.reserve)} headroom (NCCL buffers, CUDA context, fragmentation)"
        if self.budget is None:
            return head + "; no budget to compare with (set site slurm.device_memory)" + self._host_clause()
        share = f", {self.required / max(1, self.budget):.0%} of"
        if self.reserve:
            share = f" = {format_bytes(self.required)}" + share
        line = head + f"{share} budget {format_bytes(self.budget)} ({self.budget_source}){self._host_clause()}"
        if self.tight:
            return line + f": tight (over {TIGHT_FRACTION:.0%} of the budget: it may run, or run out of memory)"
        if self.host_exceeded and self.required <= self.budget:
            return line + ": does not fit (host memory per node)"
        return line + f": {self.verdict}"

    def fit_advice(self, indent: str = "", where: str = "") -> list[str]:
        """For a run that does not fit (or fits tightly): the changes that would make it fit (with
        room), cheapest first, under a header (or one line saying none does); ``where`` is
        appended to that first line."""
        fitting = [
            f"{s.change}  -> {format_bytes(s.required)}{' (tight)' if s.verdict == 'tight' else ''} ({s.cost})"
            for s in self.suggestions
            if s.fits
        ]
        goal = "leave room" if self.tight else "make it fit"
        if not fitting:
            return [f"{indent}no single change considered would {goal}{where}"]
        return [f"{indent}changes that would {goal}, cheapest first{where}:", *(f"{indent}  {f}" for f in fitting)]

    def _table(self) -> list[str]:
        """The components, the phases (with measured peaks), the headroom and the host memory."""
        lines = [f"  {'component':18} {'per device':>12}"]
        for name in COMPONENTS:
            lines.append(f"  {name:18} {format_bytes(self.components.get(name, 0)):>12}")
        lines.append(f"  {'peak (' + _peak_phase(self.phases) + ')':18} {format_bytes(self.peak):>12}")
        for phase in PHASES:
            figure = f"  {'  ' + phase:18} {format_bytes(self.phases.get(phase, 0)):>12}"
            seen = _measured_figure(self.measured, phase, self.device)
            if seen is not None:
                figure += f"   measured {format_bytes(seen)} ({self.phases.get(phase, 0) / max(seen, 1):.2f}x)"
            lines.append(figure)
        for name, value in self.headroom.items():
            lines.append(f"  {'+ ' + HEADROOM_LABELS.get(name, name):18} {format_bytes(value):>12}")
        if self.reserve:
            lines.append(f"  {'= required':18} {format_bytes(self.required):>12}")
        if self.host_offload_bytes:
            lines.append(f"  (host memory for offloaded activations: {format_bytes(self.host_offload_bytes)} per rank)")
        if self.host_per_node:
            lines.append(f"  (pinned host memory per node: {format_bytes(self.host_per_node)})")
        return lines

    def format(self) -> str:
        """The table ``jobgen plan`` prints."""
        if self.unavailable:
            return self.summary()
        assert self.inputs is not None
        i = self.inputs
        kind = "GPU, max_memory_allocated" if self.device == "cuda" else "CPU, peak RSS of a rank"
        lines = [
            f"model {self.model_path}: {self.param_count / 1e6:.1f}M parameters"
            f" ({self.trainable_params / 1e6:.1f}M trainable)"
            + (", counted from config.json (no safetensors)" if self.param_source == "config.json" else ""),
            f"{i.parallelism} on {i.world_size} rank(s)"
            + (f" ({self.pipeline.describe()})" if self.pipeline else "")
            + (f" ({' + '.join(map(str, i.node_procs))} per node)" if i.node_procs else "")
            + f", {kind}; micro-batch {i.micro_batch_size} x "
            f"{i.seq_len} tokens, {i.optimizer}"
            + (f", sharded over {i.shard}" if i.strategy.groups_by_node else "")
            + (", CPU offload" if i.offloaded else "")
            + (", checkpointing" if i.gradient_checkpointing else "")
            + (", activation offloading" if i.activation_offloading else "")
            + (", optimizer in backward" if i.optimizer_in_backward else "")
            + (f", loss chunks of {i.loss_chunk_tokens}" if i.loss_chunk_tokens else ""),
            "",
            *self._table(),
            *self._pipeline_lines(),
            "",
            self.summary(),
        ]
        lines += [f"note: {n}" for n in self.notes]
        if self.tight:
            lines.append(f"warning: tight: {self.required / max(1, self.budget or 1):.0%} of the budget")
        if self.fits is False or self.tight:
            lines += self.fit_advice()
        return "\n".join(lines + self._network_lines())


def _peak_phase(phases: dict[str, int]) -> str:
    return max(phases, key=lambda p: phases[p]) if phases else "-"


def _measured_figure(measured: dict[str, Any] | None, phase: str, device: str) -> int | None:
    if not measured:
        return None
    highest = measured.get("max_over_ranks")
    figures = (highest if isinstance(highest, dict) and highest else measured).get(phase)
    if not isinstance(figures, dict):
        return None
    key = "gpu_max_allocated_mib" if device == "cuda" else "host_rss_peak_mib"
    value = figures.get(key)
    # A figure jobgen wrote is a number of MiB a machine can have: anything else is no figure.
    plausible = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 2**40
    return int(value * MIB) if plausible else None


def inputs_for(spec: Any, model_info: ModelInfo | None = None) -> PlanInputs:
    """PlanInputs from a ResolvedSpec (duck-typed: jobgen.spec.loader.ResolvedSpec); ``model_info``
    names the layers [model.lora] adapts when its targets are a pattern ('all-linear')."""
    run = spec.run
    model, data, train = run.model, run.data, run.train
    lora = model.lora
    try:
        grad_accum = grad_accum_for(train, spec.world_size)
    except GlobalBatchError:  # the loader refuses such a spec; plan with the key as written
        grad_accum = train.grad_accum
    return PlanInputs(
        device="cuda" if spec.site.slurm.computes_on_gpu else "cpu",
        dtype=model.dtype,
        parallelism=train.parallelism,
        world_size=spec.world_size,
        nodes=run.job.nodes,
        node_procs=spec.node_procs if run.job.unequal_nodes else (),
        node_memory=run.job.node_memory() or (),
        micro_batch_size=train.micro_batch_size,
        seq_len=share_of_row(data.max_length, train.context_parallel),
        context_parallel=train.context_parallel,
        expert_parallel=train.expert_parallel,
        attn_implementation=_attention(model.attention, spec.site.slurm.computes_on_gpu, data.packing, model_info),
        grad_accum=grad_accum,
        optimizer=train.optimizer,
        gradient_checkpointing=model.gradient_checkpointing,
        # Keys being added to the spec; read defensively until every branch has them.
        activation_offloading=bool(getattr(model, "activation_offloading", False)),
        optimizer_in_backward=bool(getattr(train, "optimizer_in_backward", False)),
        loss_chunk_tokens=int(getattr(train, "loss_chunk_tokens", 0) or 0),
        per_parameter_clip=train.grad_clip > 0 and train.grad_clip_mode == "per_parameter",
        global_clip=train.grad_clip > 0 and train.grad_clip_mode == "global",
        lora_r=lora.r if lora is not None else None,
        lora_targets=_lora_leaves(lora.target_modules, model_info) if lora is not None else (),
        shard_size=train.shard_size,
        cpu_offload=train.cpu_offload,
        global_batch_size=train.global_batch_size,
        nccl=settings_from(spec.site.network.transport, job_environment(spec)),
        pipeline=_pipeline_inputs(train),
    )


def _lora_leaves(targets: list[str] | str | None, model_info: ModelInfo | None) -> tuple[str, ...]:
    """The last names of the layers LoRA adapts (q_proj...), as the estimate counts them; a
    pattern or the default (None) adapts what only the model's tensors can say."""
    if model_info is None:
        return () if targets is None or isinstance(targets, str) else tuple(t.rsplit(".", 1)[-1] for t in targets)
    modules = weight_modules(model_info.tensors)
    names = adapted(targets, modules, experts=bool(model_info.traits.experts))
    return tuple(sorted({name.rsplit(".", 1)[-1] for name in names}))


def _attention(attention: str, gpu: bool, packing: bool, model_info: ModelInfo | None) -> str:
    """model.attention as the trainer resolves "auto" (jobgen.model.traits.resolve_attention): for
    a model it can read, by what its family supports (Gemma 2: eager, whose scores grow with T^2)."""
    if model_info is None:
        return attention if attention != "auto" else ("flex_attention" if gpu and packing else "sdpa")
    return model_info.traits.attention(attention, gpu=gpu, packing=packing)


def _pipeline_inputs(train: Any) -> PipelineInputs | None:
    """[train.pipeline] of a pipeline run (None for any other parallelism)."""
    pipe = getattr(train, "pipeline", None)
    if not STRATEGIES[train.parallelism].pipelined or pipe is None:
        return None
    layers = tuple(pipe.layers_per_stage) if pipe.layers_per_stage is not None else None
    return PipelineInputs(pipe.size, pipe.stages, pipe.schedule, pipe.microbatches, layers, pipe.data_parallel)


def job_environment(spec: Any) -> dict[str, str]:
    """The variables the job exports as the batch script writes them: the site's [env], its
    [network.env], then the run's [env], which wins."""
    return {**spec.site.env, **spec.site.network.env, **spec.run.env}


def read_measured(run_dir: Path) -> dict[str, Any] | None:
    """The peaks a run measured (metrics.json's ``memory_peaks``), or None when there are none
    that can be read: they are shown beside the plan, never needed by it. Read as any file of
    a run is (jobgen.base.safe_read: no FIFO, device or link, bounded)."""
    try:
        data = read_json(Path(run_dir) / "metrics.json")
    except (FileNotFoundError, DamagedFile):
        return None
    peaks = data.get("memory_peaks") if isinstance(data, dict) else None
    return peaks if isinstance(peaks, dict) else None


def plan_run(spec: Any) -> MemoryPlan:
    """The plan for a ResolvedSpec of a training run (see :class:`MemoryPlan`). A model that
    cannot be looked at (a hub id) gives a plan that cannot estimate; malformed model files
    (ModelFileError) and a local model whose size cannot be worked out (UnsizedModel) raise,
    for the caller to report as it sees fit."""
    run = spec.run
    device = "cuda" if spec.site.slurm.computes_on_gpu else "cpu"
    path = run.model.path if run.model else ""
    plan = MemoryPlan(model_path=path, device=device, world_size=spec.world_size)
    if run.model is None or run.data is None:
        plan.unavailable = "not a training run"
        return plan
    try:
        model = read_model(path)
    except (ModelFileError, UnsizedModel):
        raise
    except PlanError as exc:
        plan.unavailable = str(exc)
        return plan
    inputs = inputs_for(spec, model)
    try:
        est = estimate_run(model, inputs)
    except PipelineLayoutError as exc:
        plan.unavailable = f"the pipeline cannot be laid out: {exc}"
        return plan
    plan.inputs = inputs
    if isinstance(est, PipelineEstimate):
        plan.pipeline, plan.positions = est.layout, est.positions
    plan.components, plan.phases, plan.peak = est.components, est.phases, est.peak
    plan.host_offload_bytes = est.host_offload_bytes
    plan.param_count, plan.trainable_params = model.param_count, est.trainable_params
    plan.param_source = model.counted_from
    plan.notes = est.notes
    plan.host_per_node = host_bytes_per_node(est, inputs)
    plan.host_budget, plan.host_budget_source = host_budget_for(spec)
    plan.budget, plan.budget_source = budget_for(spec)
    tightest = tightest_position(plan.positions, inputs)
    if tightest is not None:  # job.device_memory: the verdict is the tightest position's
        position, plan.position_budgets = tightest
        plan.tightest, chosen = position.position, position.estimate
        plan.components, plan.phases, plan.peak = chosen.components, chosen.phases, chosen.peak
        plan.budget = plan.position_budgets[position.position]
        plan.budget_source = f"job.device_memory: pipeline position {position.position}'s nodes, the tightest"
    # What the GPU needs beyond the peak, of the position the verdict is about (its NCCL
    # buffers, its fragmentation): the tightest's with job.device_memory, else the busiest's.
    plan.headroom = headroom(chosen if tightest is not None else est, inputs)
    plan.reserve = sum(plan.headroom.values())
    plan.measured = read_measured(spec.run_dir)
    budgets = Budgets(plan.budget, plan.host_budget) if plan.budget is not None else None
    # What the run has on that a parallelism may refuse, [eval] among them, which the inputs
    # do not hold: no change is suggested that the spec would refuse.
    held = run.turned_on()
    if budgets is not None and (plan.fits is False or plan.tight):
        plan.suggestions = suggestions(model, inputs, budgets, spec.procs_per_node, tight=plan.tight, held=held)
    plan.network_suggestions = network_suggestions(model, inputs, budgets, held=held)
    return plan
