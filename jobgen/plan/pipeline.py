"""The memory of ``train.parallelism = "pipeline"``, one pipeline position at a time, from the
same parts as every other estimate (:mod:`jobgen.plan.estimate`); ``jobgen plan`` reports
the busiest position as the rank's figure and lists them all.

What a position holds (trainer/parallel/pipeline_steps.py, trainer/parallel/pipeline.py, torch 2.13's
``torch.distributed.pipelining``)
    - Layout: ``pp = train.pipeline.size`` positions (default the world) x ``dp = world / pp``
      replicas; position ``p`` holds the stages ``jobgen.model.pipeline_split.stage_indices`` gives
      it, each stage's blocks from ``stage_layers`` with the embedding and the output layer
      weighted as the trainer weighs them (:func:`embed_and_head_weights`, its
      ``_embed_and_head_weights`` computed from the model's shapes). Stage 0 also holds the
      input embedding; the last stage the final norm, ``lm_head`` and the loss.
    - States: the position's parameters, gradients and optimizer state
      (:func:`jobgen.plan.estimate.state_bytes` of the position's tensors), divided by
      ``dp`` when ``data_parallel = "fsdp"`` and there are several replicas, whole for
      ``"ddp"`` (FSDP2's replicate) and for a single pipeline.
    - FSDP's gathered copies: each block and stage is ``fully_shard``-ed with
      ``reshard_after_forward=False``, and torch's stages turn off resharding after backward
      and gradient reduction until the schedule's last backward (``backward_maybe_with_nosync``,
      then ``perform_reduce_grad``): through the forward/backward, the position's whole
      parameters stay gathered and its unsharded gradients accumulate. Both are counted as
      transient buffers; with replicas (either kind) the reduction's copy of the largest
      unit's gradients too (float32 on a GPU).
    - Pieces: a step's ``grad_accum`` micro-batches go through one schedule step, each split
      into ``microbatches`` pieces: ``pieces = microbatches x grad_accum`` of
      ``micro_batch_size / microbatches`` rows.
    - Activations of the pieces in flight (run forward, not yet backward): each piece keeps
      :func:`jobgen.plan.estimate.activation_parts`'s ``kept_per_layer`` for every block it
      went through on this position, plus the stage's output (kept by torch until its
      backward), the rotary tables and the attention mask; one backward's working set on top.
      How many pieces are in flight is the schedule's, :func:`stage_pieces_in_flight`.
    - Logits: ``piece rows x T x vocab`` of them on the last position only: one piece's loss
      in full (:func:`jobgen.plan.estimate.logit_bytes`: the logits, the float32
      log-softmax saved for backward and the gradients of both), and for each further piece
      the last stage holds before its backward (all of them under gpipe and looped-bfs, none
      under the other schedules) what it keeps: its logits (torch keeps a stage's output until
      its backward) and the float32 log-softmax.
    - Send/receive buffers: torch allocates one receive buffer per piece for each stage's
      input (not the first stage) and output gradient (not the last), kept for the run, and
      the input gradients it sends back stay until the next step: ``pieces x piece tokens x
      hidden`` each.
    - NCCL: a communicator for the world, the pipeline group and the replica group.

Bounds rather than exact figures: a multi-stage position's stage-pieces are each counted with
its largest stage, and the zero-bubble schedules' pieces whose weight gradient is deferred as
whole pieces (they keep only the linear layers' inputs). Not modelled: the shape inference a
schedule runs at its first step and after a batch shape changes (one more forward and
backward of piece 0, which the first step's peak may show).

Checked on CPU against the trainer's measured peaks (2 ranks, a 58M-parameter Llama of 8
blocks, 512-token rows, micro-batch 4, AdamW; plan / measured peak RSS of the busiest rank):
1f1b 1.00, 1f1b with grad_accum 2 1.00, gpipe 1.06, gpipe with grad_accum 2 1.06, one
position with 2 replicas 1.07 (fsdp) and 0.95 (ddp).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from jobgen.base.sizes import format_bytes
from jobgen.model.files import ModelInfo
from jobgen.model.parallelism import STRATEGIES
from jobgen.model.pipeline_split import (
    NodeMemory,
    PipelineSplitError,
    stage_capacities,
    stage_indices,
    stage_layers,
)
from jobgen.model.traits import BLOCK_INDEX as BLOCK_NAME
from jobgen.plan.context_parallel import with_context_parallel
from jobgen.plan.estimate import (
    LOAD_TRANSIENT,
    ActivationParts,
    Estimate,
    activation_parts,
    estimate,
    logit_bytes,
    overhead_bytes,
    runtime_buffer_bytes,
    state_bytes,
    step_phases,
)
from jobgen.plan.inputs import PlanInputs
from jobgen.plan.nccl import buffer_bytes
from jobgen.spec.tables.pipeline import PipelineSpec

# Schedules that run every forward of a rank's stages before any backward.
ALL_FORWARDS_FIRST = ("gpipe", "looped-bfs")


class PipelineLayoutError(ValueError):
    """The pipeline cannot be laid out on this world and model; the message names the key."""


@dataclass(frozen=True)
class Layout:
    """How a step runs: positions, replicas, stages and the pieces of a step."""

    pp: int  # pipeline positions
    dp: int  # replicas of each position
    schedule: str
    data_parallel: str
    microbatches: int  # pieces per micro-batch
    pieces: int  # pieces per step: microbatches x grad_accum
    rows: int  # rows per piece
    ranges: tuple[range, ...]  # every stage's blocks

    def stages_of(self, position: int) -> list[int]:
        return stage_indices(self.schedule, position, self.pp, len(self.ranges))

    @property
    def sharded(self) -> bool:
        """FSDP2 shards each position over its replicas (train.pipeline.data_parallel's entry)."""
        return STRATEGIES[self.data_parallel].shards_parameters and self.dp > 1

    def describe(self) -> str:
        replicas = f", {self.data_parallel} over the replicas" if self.dp > 1 else ""
        return (
            f"{_count(self.pp, 'position')} x {_count(self.dp, 'replica')}{replicas}, "
            f"{_count(len(self.ranges), 'stage')}, schedule {self.schedule}, "
            f"{_count(self.pieces, 'piece')} of {_count(self.rows, 'row')} a step"
        )


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


@dataclass
class PositionEstimate:
    """One pipeline position: what it holds and its estimate."""

    position: int
    stages: list[int]
    blocks: list[range]
    embedding: bool
    head: bool
    pieces_in_flight: int  # stage-pieces run forward and not yet backward, at most
    estimate: Estimate

    def label(self) -> str:
        what = ", ".join(f"{r.start}-{r.stop - 1}" for r in self.blocks)
        extras = (["embedding"] if self.embedding else []) + (["norm + lm_head + loss"] if self.head else [])
        many = "s" if len(self.stages) > 1 else ""
        return (
            f"position {self.position}, stage{many} {', '.join(map(str, self.stages))} "
            f"(blocks {what}{''.join(', ' + e for e in extras)})"
        )

    def line(self, pieces: int) -> str:
        c = self.estimate.components
        state = c["parameters"] + c["gradients"] + c["optimizer_state"]
        logits = f", logits {format_bytes(c['logits'])}" if self.head else ""
        return (
            f"{self.label()}: {format_bytes(self.estimate.peak)}; states {format_bytes(state)}, "
            f"activations {format_bytes(c['activations'])} ({self.pieces_in_flight} of {_count(pieces, 'piece')} "
            f"in flight){logits}, buffers {format_bytes(c['buffers'])}"
        )

    def to_json(self) -> dict:
        return {
            "position": self.position,
            "stages": self.stages,
            "blocks": [[r.start, r.stop - 1] for r in self.blocks],
            "embedding": self.embedding,
            "head": self.head,
            "pieces_in_flight": self.pieces_in_flight,
            "components": dict(self.estimate.components),
            "phases": dict(self.estimate.phases),
            "peak_bytes": self.estimate.peak,
        }


@dataclass
class PipelineEstimate(Estimate):
    """The busiest position's estimate (the rank's figure), with every position's."""

    layout: Layout | None = None
    positions: list[PositionEstimate] = field(default_factory=list)


def estimate_run(model: ModelInfo, inputs: PlanInputs) -> Estimate:
    """One rank's estimate of any run: :func:`estimate_pipeline` for a pipeline, else
    :func:`jobgen.plan.estimate.estimate` (with train.context_parallel's share of each row)."""
    if inputs.strategy.pipelined:
        return estimate_pipeline(model, inputs)
    return with_context_parallel(estimate(model, inputs), model, inputs)


def embed_and_head_weights(model: ModelInfo) -> tuple[float, float]:
    """The embedding and the output layer plus the final norm in units of one decoder block's
    parameters, as trainer.parallel.pipeline_steps._embed_and_head_weights computes them from the
    config (head_dim from the query projection's shape, else hidden / heads)."""
    hidden, heads, kv = model.hidden_size, model.num_heads, model.num_kv_heads
    query = next((t for t in model.tensors if t.name.endswith("q_proj.weight") and len(t.shape) == 2), None)
    head_dim = query.shape[0] // heads if query is not None else hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    block = attention + 3 * hidden * model.intermediate_size + 2 * hidden
    table = model.vocab_size * hidden
    return table / block, (table + hidden) / block


def layout_of(model: ModelInfo, inputs: PlanInputs) -> Layout:
    """The pipeline of ``inputs`` on ``model``; PipelineLayoutError when it cannot run."""
    given = inputs.pipeline
    if given is None:
        raise PipelineLayoutError("train.parallelism = 'pipeline' without its [train.pipeline] settings")
    settings = asdict(given)
    if settings["layers_per_stage"] is not None:
        settings["layers_per_stage"] = list(settings["layers_per_stage"])
    spec = PipelineSpec(**settings)
    problem = spec.world_problem(inputs.world_size, inputs.micro_batch_size)
    if problem:
        raise PipelineLayoutError(problem[1])
    mesh = inputs.mesh  # the positions and their replicas, as the trainer lays them out
    stages = spec.stage_count(inputs.world_size)
    embed, head = embed_and_head_weights(model)
    try:
        layers = settings["layers_per_stage"]
        capacities = None
        if inputs.node_memory and layers is None:  # the trainer's split, from the same numbers
            nodes = NodeMemory(inputs.procs_of_nodes, inputs.node_memory)
            capacities = stage_capacities(mesh, spec.schedule, stages, nodes)
        ranges = stage_layers(
            model.num_layers,
            stages,
            layers_per_stage=layers,
            embed_weight=embed,
            head_weight=head,
            capacities=capacities,
        )
    except PipelineSplitError as exc:
        raise PipelineLayoutError(str(exc)) from None
    micro = spec.microbatch_count(inputs.micro_batch_size)
    return Layout(
        pp=mesh.pp,
        dp=mesh.dp,
        schedule=spec.schedule,
        data_parallel=spec.data_parallel,
        microbatches=micro,
        pieces=micro * inputs.grad_accum,
        rows=inputs.micro_batch_size // micro,
        ranges=tuple(ranges),
    )


def position_budgets(inputs: PlanInputs) -> list[int] | None:
    """Each pipeline position's device memory with job.device_memory: the least among its
    ranks' nodes (its replicas hold the same stages); None without per-node memory."""
    if not inputs.node_memory:
        return None
    mesh = inputs.mesh
    rank_memory = [m for procs, m in zip(inputs.procs_of_nodes, inputs.node_memory) for _ in range(procs)]
    budgets = [min(rank_memory[p * mesh.dp : (p + 1) * mesh.dp]) for p in range(mesh.pp)]
    return budgets if len(rank_memory) == mesh.world else None


def pipeline_problem(model: ModelInfo, inputs: PlanInputs, held: frozenset[str] = frozenset()) -> str | None:
    """Why ``inputs``' pipeline cannot run on ``model`` (None when it can), as far as the
    estimate's inputs and ``held`` (what else the run has on: its [eval]) tell: the settings
    the pipeline's entry refuses (jobgen.model.parallelism) and the layout."""
    refusal = inputs.strategy.refusal(inputs.turned_on() | held)
    if refusal is not None:
        return f"{' with '.join(refusal.keys)} cannot be combined with train.parallelism = '{inputs.parallelism}'"
    try:
        layout_of(model, inputs)
    except PipelineLayoutError as exc:
        return str(exc)
    return None


def stage_pieces_in_flight(layout: Layout, position: int) -> int:
    """Stage-pieces (one piece through one of the position's stages) that ``position`` has run
    forward and not yet backward, at their most, from torch 2.13's schedules (schedules.py):

    - gpipe, looped-bfs: every forward before any backward: ``pieces x local stages``.
    - 1f1b: ``Schedule1F1B``'s warm-up, ``min(pieces, stages - stage)``, then one backward
      before each further forward ("1B1F"): ``min(pp - position, pieces)``.
    - interleaved-1f1b: ``_get_warmup_ops`` (multiply_factor 2):
      ``(local stages - 1) x pieces per round + 2 (pp - 1 - position)``, plus the forward that
      ``_get_1f1b_rank_ops`` runs before each backward in its steady phase.
    - interleaved-zero-bubble: the same with multiply_factor 1, plus the ``position`` weight
      gradients it defers (``num_1f1b_microbatches = rank``), counted as whole pieces (they
      keep less: the inputs of the linear layers).
    - zbv-zero-bubble: ``2 (pp - position) - 1 + position`` forwards of chunk 0 and
      ``position + 1`` of chunk 1 before the steady phase, which keeps that count: ``2 pp``.
    - dualpipev: the same ``2 pp`` after its steps 1-2, plus the forward of an overlapped
      forward-backward pair: ``2 pp + 1``.

    Each capped at every piece through every local stage."""
    local, pieces, pp = len(layout.stages_of(position)), layout.pieces, layout.pp
    most = pieces * local
    name = layout.schedule
    if name in ALL_FORWARDS_FIRST:
        return most
    if name == "1f1b":
        return min(pp - position, pieces)
    if name in ("interleaved-1f1b", "interleaved-zero-bubble"):
        per_round = pieces // max(1, pieces // pp)
        factor, deferred = (2, 0) if name == "interleaved-1f1b" else (1, position)
        warmup = min((local - 1) * per_round + factor * (pp - 1 - position), most)
        return min(warmup + 1 + deferred, most)
    if name == "zbv-zero-bubble":
        return min(2 * pp, most)
    return min(2 * pp + 1, most)  # dualpipev


def _block_pieces(layout: Layout, position: int, in_flight: int) -> int:
    """Blocks x pieces whose saved activations the position holds at once: exact for the
    schedules that hold whole pieces through all their stages, else each stage-piece counted
    with the position's largest stage."""
    stages = layout.stages_of(position)
    blocks = sum(len(layout.ranges[s]) for s in stages)
    if layout.schedule in ALL_FORWARDS_FIRST or len(stages) == 1:
        return in_flight * blocks // len(stages)
    return min(in_flight * max(len(layout.ranges[s]) for s in stages), layout.pieces * blocks)


def position_model(model: ModelInfo, blocks: set[int], embedding: bool, head: bool) -> ModelInfo:
    """The part of ``model`` one position holds: its blocks' tensors, the input embedding (and
    GPT-2's absolute positions) on the first position, every other tensor outside the blocks
    (final norm, lm_head) on the last, which holds a copy of a tied embedding as its head."""
    kept = []
    for t in model.parameters:
        match = BLOCK_NAME.search(t.name)
        if match:
            if int(match[1]) in blocks:
                kept.append(t)
        elif t.name.endswith(EMBEDDING_NAMES):
            kept += [t] if embedding else []
            if head and model.tie_word_embeddings and not t.name.endswith("wpe.weight"):
                kept.append(replace(t, name="lm_head.weight"))
        elif head:
            kept.append(t)
    return replace(model, tensors=tuple(kept), num_layers=len(blocks), tie_word_embeddings=False)


# The first position's tensors outside the blocks: the input embedding (Llama's, GPT-2's, GPT-NeoX's)
# and GPT-2's position embedding.
EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "embed_in.weight", "wpe.weight")


def _position_inputs(inputs: PlanInputs, layout: Layout) -> PlanInputs:
    """One position as a run of its own: ``dp`` ranks of FSDP (or whole copies), a piece's rows."""
    return replace(
        inputs,
        parallelism="fsdp" if layout.sharded else "ddp",
        world_size=layout.dp,
        nodes=1,
        node_procs=(),
        shard_size=None,
        micro_batch_size=layout.rows,
        # Gradients live through the whole forward/backward when they accumulate over the pieces
        # in .grad (one pipeline or replicate); FSDP's unsharded ones are in its transient buffers.
        grad_accum=1 if layout.sharded else layout.pieces,
        pipeline=None,
    )


def _transient_bytes(sub: ModelInfo, piece: PlanInputs, layout: Layout, trainable: int) -> int:
    """FSDP's gathered parameters and unsharded gradients of the whole position, and the
    reduction's copy of the largest unit's gradients with replicas."""
    out = 0
    if layout.sharded:
        out += sub.param_count * piece.param_bytes + trainable * piece.param_bytes
    if layout.dp > 1:
        unit = max(sub.block_numel, sub.root_numel)
        out += unit * (4 if piece.device == "cuda" else piece.param_bytes)
    return out


def _p2p_bytes(layout: Layout, stages: list[int], piece: PlanInputs, hidden: int) -> int:
    """torch's receive buffers (input, output gradient) per piece and the input gradients sent back."""
    per_piece = piece.micro_batch_size * piece.seq_len * hidden * piece.act_bytes
    last = len(layout.ranges) - 1
    copies = sum((s != 0) * 2 + (s != last) for s in stages)
    return layout.pieces * per_piece * copies


def _activations(sub: ModelInfo, piece: PlanInputs, parts: ActivationParts, counts: tuple[int, int, int]) -> int:
    """Saved activations of the pieces in flight: ``counts`` = (block-pieces, stage-pieces,
    pieces through the final norm)."""
    block_pieces, stage_pieces, normed = counts
    rotary, mask = runtime_buffer_bytes(sub, piece)
    boundary = piece.micro_batch_size * piece.seq_len * sub.hidden_size * piece.act_bytes
    return (
        block_pieces * parts.kept_per_layer
        + stage_pieces * (boundary + rotary + mask)
        + parts.working
        + normed * parts.final_norm
    )


def _logits(sub: ModelInfo, piece: PlanInputs, head_pieces: int) -> int:
    """One piece's loss in full, and the logits and float32 log-softmax of each further piece."""
    if not head_pieces:
        return 0
    kept = piece.micro_batch_size * piece.seq_len * sub.vocab_size * (piece.act_bytes + 4)
    return logit_bytes(sub, piece) + (head_pieces - 1) * kept


def estimate_position(model: ModelInfo, inputs: PlanInputs, layout: Layout, position: int) -> PositionEstimate:
    """The estimate of one pipeline position (see the module docstring)."""
    stages = layout.stages_of(position)
    first, head = 0 in stages, len(layout.ranges) - 1 in stages
    blocks = sorted({b for s in stages for b in layout.ranges[s]})
    sub = position_model(model, set(blocks), first, head)
    piece = _position_inputs(inputs, layout)
    states, tr = state_bytes(sub, piece)
    in_flight = stage_pieces_in_flight(layout, position)
    head_pieces = (layout.pieces if layout.schedule in ALL_FORWARDS_FIRST else 1) if head else 0
    counts = (_block_pieces(layout, position, in_flight), in_flight, head_pieces)
    overhead = overhead_bytes(piece)
    buffers = _p2p_bytes(layout, stages, piece, model.hidden_size)
    transient = _transient_bytes(sub, piece, layout, tr.count)
    raw = {
        "parameters": states["parameters"],
        "gradients": states["gradients"],
        "optimizer_state": states["optimizer_state"],
        "activations": _activations(sub, piece, activation_parts(sub, piece), counts),
        "logits": _logits(sub, piece, head_pieces),
        "buffers": buffers + transient,
        "overhead": overhead,
    }
    first_step, steady = step_phases(piece, {**raw, "step_temp": states["step_temp"]}, buffers, transient)
    # Built on meta, each rank reads its own tensors (its shards of them) into place.
    load = states["parameters"] + overhead + LOAD_TRANSIENT * sub.largest_numel * piece.param_bytes
    phases = {"load": int(load), "first_step": int(first_step), "steady": int(steady)}
    components = {name: int(value) for name, value in raw.items()} | {"nccl_buffers": _nccl(inputs, layout)}
    est = Estimate(components, phases, trainable_params=tr.count)
    ranges = [layout.ranges[s] for s in stages]
    return PositionEstimate(position, stages, ranges, first, head, in_flight, est)


def _nccl(inputs: PlanInputs, layout: Layout) -> int:
    """A communicator each for the world, the pipeline group and the replica group (GPU only)."""
    if inputs.device != "cuda":
        return 0
    return buffer_bytes(inputs.nccl, inputs.world_size, layout.pp, hierarchical=True)


def estimate_pipeline(model: ModelInfo, inputs: PlanInputs) -> PipelineEstimate:
    """Every position's estimate; the busiest one's figures are the rank's.
    PipelineLayoutError when the pipeline cannot be laid out."""
    layout = layout_of(model, inputs)
    positions = [estimate_position(model, inputs, layout, p) for p in range(layout.pp)]
    busiest = max(positions, key=lambda p: p.estimate.peak).estimate
    notes = []
    if model.tie_word_embeddings:
        notes.append("tied input and output embeddings: the first and the last position each hold a copy")
    return PipelineEstimate(
        dict(busiest.components),
        dict(busiest.phases),
        trainable_params=model.param_count,
        notes=notes,
        layout=layout,
        positions=positions,
    )
