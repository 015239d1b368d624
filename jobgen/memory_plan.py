"""The memory plan of a run, before it is queued (``jobgen plan`` and submit's check): the
estimate for its resolved spec, the budget it must fit, the verdict, and the changes that
would make it fit, each evaluated with the same estimator (:mod:`jobgen.memory_estimate`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from jobgen.memory_estimate import CUDA_CONTEXT_RESERVE, PlanInputs, estimate
from jobgen.model_files import ModelFileError, ModelInfo, PlanError, UnsizedModel, read_model
from jobgen.sizes import MIB, format_bytes, parse_size

COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations", "logits", "buffers", "overhead")
PHASES = ("load", "first_step", "steady")


@dataclass
class Suggestion:
    change: str  # what to set, e.g. "train.optimizer_in_backward = true"
    cost: str  # what it costs
    peak: int
    fits: bool

    def to_json(self) -> dict[str, Any]:
        return {"change": self.change, "cost": self.cost, "peak_bytes": self.peak, "fits": self.fits}


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
    reserve: int = 0
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

    @property
    def required(self) -> int:
        """The peak plus what the verdict reserves beyond the predicted figure."""
        return self.peak + self.reserve

    @property
    def fits(self) -> bool | None:
        if self.unavailable or self.budget is None:
            return None
        return self.required <= self.budget

    @property
    def verdict(self) -> str:
        if self.unavailable:
            return "cannot estimate"
        if self.budget is None:
            return "no budget"
        return "fits" if self.fits else "does not fit"

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
            "reserve_bytes": self.reserve,
            "required_bytes": self.required if not self.unavailable else None,
            "budget_bytes": self.budget,
            "budget_source": self.budget_source,
            "verdict": self.verdict,
            "fits": self.fits,
            "host_offload_bytes": self.host_offload_bytes,
            "suggestions": [s.to_json() for s in self.suggestions],
            "unavailable": self.unavailable,
            "notes": list(self.notes),
            "inputs": asdict(self.inputs) if self.inputs else None,
            "measured": self.measured,
        }

    def summary(self) -> str:
        """One line: the verdict with its numbers."""
        if self.unavailable:
            return f"memory plan: cannot estimate: {self.unavailable}"
        where = "GPU" if self.device == "cuda" else "rank (host memory)"
        head = f"memory plan: {format_bytes(self.peak)} per {where}"
        if self.reserve:
            head += f" + {format_bytes(self.reserve)} CUDA context reserve"
        if self.budget is None:
            return head + "; no budget to compare with (set site slurm.device_memory)"
        return head + f", budget {format_bytes(self.budget)} ({self.budget_source}): {self.verdict}"

    def fit_advice(self, indent: str = "", where: str = "") -> list[str]:
        """For a run that does not fit: the changes that would make it fit, cheapest first, under
        a header (or one line saying none does); ``where`` is appended to that first line."""
        fitting = [f"{s.change}  -> {format_bytes(s.peak)} ({s.cost})" for s in self.suggestions if s.fits]
        if not fitting:
            return [f"{indent}no single change considered makes it fit{where}"]
        return [f"{indent}changes that would make it fit, cheapest first{where}:", *(f"{indent}  {f}" for f in fitting)]

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
            f"{i.parallelism} on {i.world_size} rank(s), {kind}; micro-batch {i.micro_batch_size} x "
            f"{i.seq_len} tokens, {i.optimizer}"
            + (", checkpointing" if i.gradient_checkpointing else "")
            + (", activation offloading" if i.activation_offloading else "")
            + (", optimizer in backward" if i.optimizer_in_backward else "")
            + (f", loss chunks of {i.loss_chunk_tokens}" if i.loss_chunk_tokens else ""),
            "",
            f"  {'component':18} {'per device':>12}",
        ]
        for name in COMPONENTS:
            lines.append(f"  {name:18} {format_bytes(self.components.get(name, 0)):>12}")
        lines.append(f"  {'peak (' + _peak_phase(self.phases) + ')':18} {format_bytes(self.peak):>12}")
        for phase in PHASES:
            figure = f"  {'  ' + phase:18} {format_bytes(self.phases.get(phase, 0)):>12}"
            seen = _measured_figure(self.measured, phase, self.device)
            if seen is not None:
                figure += f"   measured {format_bytes(seen)} ({self.phases.get(phase, 0) / max(seen, 1):.2f}x)"
            lines.append(figure)
        if self.reserve:
            lines.append(f"  {'+ CUDA reserve':18} {format_bytes(self.reserve):>12}")
        if self.host_offload_bytes:
            lines.append(f"  (host memory for offloaded activations: {format_bytes(self.host_offload_bytes)})")
        lines += ["", self.summary()]
        lines += [f"note: {n}" for n in self.notes]
        if self.fits is False:
            lines += self.fit_advice()
        return "\n".join(lines)


def _peak_phase(phases: dict[str, int]) -> str:
    return max(phases, key=lambda p: phases[p]) if phases else "-"


def _measured_figure(measured: dict[str, Any] | None, phase: str, device: str) -> int | None:
    if not measured:
        return None
    figures = (measured.get("max_over_ranks") or measured).get(phase)
    if not isinstance(figures, dict):
        return None
    key = "gpu_max_allocated_mib" if device == "cuda" else "host_rss_peak_mib"
    value = figures.get(key)
    return int(value * MIB) if isinstance(value, (int, float)) else None


class _Change:
    """One candidate change: its spec keys as text, what it costs, and the inputs it updates."""

    def __init__(self, label: str, cost: str, **updates: Any):
        self.label, self.cost, self.updates = label, cost, updates

    def __call__(self, inputs: PlanInputs) -> PlanInputs:
        return replace(inputs, **self.updates)


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
    if inputs.parallelism == "ddp" and inputs.world_size > 1:
        out.append(_Change('train.parallelism = "fsdp"', "more communication", parallelism="fsdp"))
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
    per_node = max(1, procs_per_node)
    for factor in (2, 4, 8, 16):
        nodes = inputs.nodes * factor
        fsdp = "" if inputs.parallelism == "fsdp" else ', train.parallelism = "fsdp"'
        out.append(
            _Change(f"job.nodes = {nodes}{fsdp}", f"{factor}x the nodes",
                    nodes=nodes, world_size=nodes * per_node, parallelism="fsdp")
        )  # fmt: skip
    length = inputs.seq_len
    while length > 256:
        length //= 2
        out.append(_Change(f"data.max_length = {length}", "shorter rows: changes what is learned", seq_len=length))
    return out


def suggestions(model: ModelInfo, inputs: PlanInputs, budget: int, reserve: int, procs_per_node: int):
    """Each candidate change evaluated with the same estimator; the fitting ones, cheapest first
    (of the node counts and max_lengths only the first that fits). When no single change fits,
    the candidates applied together in order until the run fits, as one suggestion."""
    found: list[Suggestion] = []
    seen_nodes = seen_length = False
    for change in _candidates(inputs, procs_per_node):
        label, cost = change.label, change.cost
        peak = estimate(model, change(inputs)).peak
        fits = peak + reserve <= budget
        if not fits:
            continue
        if label.startswith("job.nodes"):
            if seen_nodes:
                continue
            seen_nodes = True
        if label.startswith("data.max_length"):
            if seen_length:
                continue
            seen_length = True
        found.append(Suggestion(label, cost, peak, fits))
    if found:
        return found
    # No single change: apply them together in order until the run fits, then drop each one
    # that is not needed after all.
    steps = []
    current = inputs
    for change in _candidates(inputs, procs_per_node):
        if change.label.startswith(("job.nodes", "data.max_length", "train.micro_batch_size")):
            continue
        changed = change(current)
        if changed == current:
            continue
        steps.append((change.label, change))
        current = changed
        if estimate(model, current).peak + reserve <= budget:
            break
    else:
        return []
    for item in list(reversed(steps)):
        trial = [s for s in steps if s is not item]
        candidate = inputs
        for _, change in trial:
            candidate = change(candidate)
        if estimate(model, candidate).peak + reserve <= budget:
            steps = trial
    final = inputs
    for _, change in steps:
        final = change(final)
    peak = estimate(model, final).peak
    return [Suggestion("; ".join(label for label, _ in steps), "all of these together", peak, True)]


def inputs_for(spec: Any) -> PlanInputs:
    """PlanInputs from a ResolvedSpec (duck-typed: jobgen.loader.ResolvedSpec)."""
    run = spec.run
    model, data, train = run.model, run.data, run.train
    lora = model.lora
    return PlanInputs(
        device="cuda" if spec.site.slurm.gpus_per_node > 0 else "cpu",
        dtype=model.dtype,
        parallelism=train.parallelism,
        world_size=spec.world_size,
        nodes=run.job.nodes,
        micro_batch_size=train.micro_batch_size,
        seq_len=data.max_length,
        grad_accum=train.grad_accum,
        optimizer=train.optimizer,
        gradient_checkpointing=model.gradient_checkpointing,
        # Keys being added to the spec; read defensively until every branch has them.
        activation_offloading=bool(getattr(model, "activation_offloading", False)),
        optimizer_in_backward=bool(getattr(train, "optimizer_in_backward", False)),
        loss_chunk_tokens=int(getattr(train, "loss_chunk_tokens", 0) or 0),
        lora_r=lora.r if lora is not None else None,
        lora_targets=tuple(lora.target_modules) if lora is not None else (),
    )


def budget_for(spec: Any) -> tuple[int | None, str]:
    """Memory one rank may use: site slurm.device_memory, else on CPU sites slurm.mem divided
    by the processes per node; (None, why) when neither says."""
    slurm = spec.site.slurm
    given = getattr(slurm, "device_memory", None)
    if given:
        return parse_size(given), f"slurm.device_memory = {given}"
    if slurm.gpus_per_node == 0 and slurm.mem and slurm.mem != "0":
        per_node = parse_size(slurm.mem if slurm.mem[-1].isalpha() else slurm.mem + "M")  # Slurm: MiB by default
        return per_node // max(1, spec.procs_per_node), f"slurm.mem {slurm.mem} / {spec.procs_per_node} per node"
    return None, "no slurm.device_memory in the site"


def read_measured(run_dir: Path) -> dict[str, Any] | None:
    try:
        peaks = json.loads((Path(run_dir) / "metrics.json").read_text()).get("memory_peaks")
    except (OSError, ValueError, AttributeError):
        return None
    return peaks if isinstance(peaks, dict) else None


def plan_run(spec: Any) -> MemoryPlan:
    """The plan for a ResolvedSpec of a training run (see :class:`MemoryPlan`). A model that
    cannot be looked at (a hub id) gives a plan that cannot estimate; malformed model files
    (ModelFileError) and a local model whose size cannot be worked out (UnsizedModel) raise,
    for the caller to report as it sees fit."""
    run = spec.run
    device = "cuda" if spec.site.slurm.gpus_per_node > 0 else "cpu"
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
    inputs = inputs_for(spec)
    est = estimate(model, inputs)
    plan.inputs = inputs
    plan.components, plan.phases, plan.peak = est.components, est.phases, est.peak
    plan.host_offload_bytes = est.host_offload_bytes
    plan.param_count, plan.trainable_params = model.param_count, est.trainable_params
    plan.param_source = model.counted_from
    plan.notes = est.notes
    plan.reserve = CUDA_CONTEXT_RESERVE if device == "cuda" else 0
    plan.budget, plan.budget_source = budget_for(spec)
    plan.measured = read_measured(spec.run_dir)
    if plan.fits is False:
        plan.suggestions = suggestions(model, inputs, plan.budget, plan.reserve, spec.procs_per_node)
    return plan
