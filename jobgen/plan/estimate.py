"""Estimate one rank's peak memory from a model's shapes and what the run does, without torch.

What the figures mean
    On a CPU site, the peak resident set size of a trainer rank (what ``trainer.memory.peaks``
    measures as ``host_rss_peak_mib``), including the Python, torch and transformers runtime.
    On a GPU site, what ``torch.cuda.max_memory_allocated`` reports (``gpu_max_allocated_mib``);
    :func:`headroom` is what the GPU needs beyond it, which ``nvidia-smi`` shows but
    ``max_memory_allocated`` does not: NCCL's communicator buffers (the ``nccl_buffers``
    component, :mod:`jobgen.plan.nccl`), the CUDA context (:data:`CUDA_CONTEXT_RESERVE`) and
    the caching allocator's fragmentation (:data:`FRAGMENTATION_MARGIN` of the peak).

What the estimate models (``trainer/model/build.py``, ``trainer/loop.py``, ``trainer/optim.py``)
    - dtype: CPU ranks train in float32 whatever ``model.dtype``; GPU ranks hold parameters in
      ``model.dtype`` and run under bf16 autocast (FSDP2: MixedPrecisionPolicy param bf16).
    - DDP: a whole replica, its gradients and gradient buckets (about another copy of them).
    - FSDP2 (``fsdp``, ``hsdp``): parameters, gradients and optimizer state divided by the
      shard group's size (``jobgen.model.parallelism.STRATEGIES``: every rank for ``fsdp``,
      ``train.shard_size`` ranks, a node by default, for ``hsdp``), plus the
      unsharded parameters of two blocks at a time (the current one and the prefetched one)
      and of the output layer between its forward and backward (the whole root when the
      embeddings are tied), and the largest unit's unsharded gradients before the
      reduce-scatter.
    - cpu_offload (FSDP2's CPUOffloadPolicy): the shards of the parameters, gradients and
      optimizer state (and the optimizer step's temporaries) are in pinned host memory, where
      the optimizer steps; the GPU keeps the gathered blocks in flight, the unsharded
      gradients before their reduce-scatter, the activations and the logits. The host bytes
      are :attr:`Estimate.host_state_bytes` per rank.
    - AdamW: two states per trainable parameter (float32 on CPU, the parameter dtype on GPU),
      plus the step's temporaries. Adafactor: a row and a column vector per 2-D parameter,
      the full size for 1-D ones. LoRA: the base frozen (no gradients, no state).
    - optimizer_in_backward: each parameter steps as soon as its gradient is ready and the
      gradient is freed, so one gradient is alive at a time (and no DDP buckets on one rank).
    - activations: per decoder layer ``a_h*B*T*hidden + a_i*B*T*intermediate`` bytes (saved
      inputs of the norms, projections, rotary, attention and MLP), and
      ``B*heads*T*T`` more only for eager attention (the trainer uses transformers' default,
      ``sdpa``, whose memory is linear in T). Gradient checkpointing keeps one block input
      per layer plus one block's activations during its recompute; activation offloading
      moves those block inputs to pinned host memory.
    - a mixture of experts (:class:`jobgen.model.experts.MoeShape`): a MoE layer's MLP
      activations are the router's float32 logits and probabilities, each token's copies for
      its top-k experts and the experts' intermediates at their size (balanced routing: no
      expert takes more than its share), the shared experts' beside them; with
      ``train.expert_parallel`` the all-to-all's sent and received rows too, and FSDP gathers
      E / ep of each layer's experts instead of all of them.
    - logits: ``B*T*vocab`` of them, float32 for the loss and its gradient; a chunked loss
      (``loss_chunk_tokens``) keeps ``chunk*vocab``.
    - pipeline (``train.parallelism = "pipeline"``, :attr:`PlanInputs.pipeline`): not here;
      :mod:`jobgen.plan.pipeline` estimates each pipeline position from these same parts
      (:func:`state_bytes`, :func:`activation_parts`, :func:`logit_bytes`,
      :func:`step_phases`) on the position's share of the model, and ``jobgen plan`` calls it
      through :func:`jobgen.plan.pipeline.estimate_run`. :func:`estimate` itself refuses a
      pipeline, which it would otherwise treat as FSDP over the world.

The constants below were calibrated on CPU against a 374M-parameter Llama
(``bench/memory_targets.py`` measures the trainer and prints measured against predicted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jobgen.base.sizes import GIB, MIB
from jobgen.model.files import ModelInfo
from jobgen.plan.inputs import PlanInputs
from jobgen.plan.nccl import buffer_bytes

# Measured: the Python + torch + transformers runtime of one trainer rank on CPU.
CPU_RUNTIME_BYTES = 460 * MIB
# Not in max_memory_allocated: the CUDA context and the kernel images torch loads into it
# (~0.5 GiB for the context alone on an H100), and cuBLAS/NCCL handles.
CUDA_CONTEXT_RESERVE = 1 * GIB
# Not in max_memory_allocated either: what the caching allocator reserves beyond what is
# allocated at the peak (memory_reserved over max_memory_allocated). It rounds large blocks up
# to 2 MiB, cannot hand a block freed on one stream to another stream (FSDP2 all-gathers and
# reduce-scatters on streams of their own) until the stream's work is done, and splits cached
# blocks so that a free gap may be too small for the next tensor: PyTorch's out-of-memory
# error says as much ("reserved but unallocated ... to avoid fragmentation"). Training
# transformers typically sees 5-15 % of the peak reserved but unallocated; 8 % is the margin,
# an assumption until the trainer's memory_peaks record memory_reserved on a GPU.
FRAGMENTATION_MARGIN = 0.08
# Host memory of one GPU rank besides what it offloads: Python, torch, CUDA's host-side
# libraries and pinned staging buffers. Assumed, not measured (CPU ranks measured 460 MiB
# without CUDA's libraries).
GPU_RANK_HOST_BYTES = 2 * GIB
# In max_memory_allocated on GPU: cuBLAS/cuDNN workspaces and small tensors.
GPU_WORKSPACE_BYTES = 256 * MIB
# AdamW's step temporaries (foreach sqrt/div buffers), as a fraction of the trainable bytes.
ADAMW_STEP_TEMP = 0.25
# Adafactor's step temporaries: the variance estimate and the update of the largest parameter.
ADAFACTOR_STEP_TEMP = 2.0
# Loading: the tensor being converted and its source, as multiples of the largest tensor.
LOAD_TRANSIENT = 2.0
# Bytes alive per logit (B*T*vocab) with the full loss, beyond the logits' own dtype: the
# float32 log-softmax saved for backward, its gradient and the logits' gradient.
LOGIT_FP32_COPIES = 3
# One block's backward while its gradients flow: the incoming and outgoing gradients of the
# hidden stream and of the MLP's intermediate, as coefficients on B*T*hidden and
# B*T*intermediate elements.
BACKWARD_WORK_H = 4
BACKWARD_WORK_I = 3


@dataclass
class Estimate:
    """Per-device bytes per component (the steady state) and the peak of each phase."""

    components: dict[str, int]
    phases: dict[str, int]
    host_offload_bytes: int = 0
    trainable_params: int = 0
    notes: list[str] = field(default_factory=list)
    host_state_bytes: int = 0  # cpu_offload: the rank's states (and optimizer step) in host memory

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    def phase_peak(self, phase: str) -> int:
        return self.phases[phase]


def _lora_trainable(model: ModelInfo, inputs: PlanInputs) -> tuple[int, int, int]:
    """(adapter parameters, their largest tensor, adapted modules per layer)."""
    total, largest, per_layer = 0, 0, set()
    for t in model.parameters:
        parts = t.name.split(".")
        if len(t.shape) == 2 and len(parts) >= 2 and parts[-2] in inputs.lora_targets and parts[-1] == "weight":
            out_f, in_f = t.shape
            total += (inputs.lora_r or 0) * (in_f + out_f)
            largest = max(largest, (inputs.lora_r or 0) * max(in_f, out_f))
            per_layer.add(parts[-2])
    return total, largest, len(per_layer)


def _adafactor_state(shape: tuple[int, ...]) -> int:
    if len(shape) >= 2:
        lead = math.prod(shape[:-2])
        return lead * (shape[-2] + shape[-1])
    return math.prod(shape)


def layer_activation_bytes(model: ModelInfo, inputs: PlanInputs, lora_modules: int = 0) -> int:
    """Bytes one decoder layer saves for backward at micro-batch B and T tokens (a mixture of
    experts' layers averaged with its dense ones: :func:`_moe_mlp_bytes`)."""
    tokens = inputs.micro_batch_size * inputs.seq_len
    r = model.num_kv_heads / model.num_heads
    norm = 8 if inputs.act_bytes == 4 else 10  # x and x*rsqrt in fp32, plus the cast back under bf16
    a_h = 2 * norm + inputs.act_bytes * (4 + 3 * r + lora_modules)
    a_i = 4 * inputs.act_bytes
    total = tokens * (a_h * model.hidden_size + a_i * model.intermediate_size)
    if model.moe is not None and model.moe.moe_layers:
        moe = model.moe
        routed = tokens * (a_h * model.hidden_size) + _moe_mlp_bytes(model, inputs, a_i)
        total = (moe.moe_layers * routed + (model.num_layers - moe.moe_layers) * total) / model.num_layers
    if inputs.attn_implementation == "eager":
        scores = inputs.micro_batch_size * model.num_heads * inputs.seq_len**2
        total += scores * (4 + (inputs.act_bytes if inputs.act_bytes != 4 else 0))
    return int(total)


def _moe_mlp_bytes(model: ModelInfo, inputs: PlanInputs, a_i: int) -> float:
    """What a MoE layer's MLP saves for backward: the router's float32 logits and
    probabilities over the experts, each token's copy for each of its top-k experts (gathered
    in, weighted out) and the experts' intermediates at their own size, the shared experts'
    as a dense MLP's; with expert parallelism the rows sent and received by the all-to-all
    too (balanced routing: a rank receives as many rows as it sends)."""
    assert model.moe is not None
    moe, ab = model.moe, inputs.act_bytes
    tokens = inputs.micro_batch_size * inputs.seq_len
    pairs = tokens * moe.top_k
    copies = 2 + (2 if inputs.expert_parallel > 1 else 0)
    return (
        tokens * moe.experts * 4 * 2
        + pairs * model.hidden_size * ab * copies
        + a_i * (pairs * moe.expert_intermediate + tokens * moe.shared_intermediate)
    )


def moe_note(model: ModelInfo, inputs: PlanInputs) -> str:
    """What the plan says of a mixture of experts: its routing and, per expert-parallel degree,
    each rank's experts and the rows its all-to-all moves."""
    assert model.moe is not None
    moe, ep = model.moe, inputs.expert_parallel
    said = f"mixture of experts: {moe.experts} experts in each of {moe.moe_layers} MoE layers, top-{moe.top_k}"
    if ep == 1:
        return said + "; every rank's FSDP unit gathers all of a layer's experts (train.expert_parallel = 1)"
    rows = inputs.micro_batch_size * inputs.seq_len * moe.top_k
    return (
        f"{said}; train.expert_parallel = {ep}: {moe.experts // ep} experts per rank, {rows} rows of "
        f"{model.hidden_size} sent and received by each all-to-all (balanced routing assumed; a skewed "
        "router sends more to its favourite experts' ranks)"
    )


def _mlp_width(model: ModelInfo) -> float:
    """The intermediate width one token's backward works through, averaged over the layers."""
    moe = model.moe
    if moe is None or not moe.moe_layers:
        return model.intermediate_size
    routed = moe.top_k * moe.expert_intermediate + moe.shared_intermediate
    return (moe.moe_layers * routed + (model.num_layers - moe.moe_layers) * model.intermediate_size) / model.num_layers


@dataclass(frozen=True)
class Trainable:
    """What the optimizer trains: the whole model, or LoRA's adapters with the base frozen."""

    lora: bool
    adapter_params: int  # LoRA's adapter parameters (0 without LoRA)
    count: int  # trainable parameters
    largest: int  # numel of the largest trainable tensor
    lora_modules: int  # adapted modules per layer
    grad_bytes: int  # bytes per gradient element

    @property
    def bytes(self) -> int:
        return self.count * self.grad_bytes


def _trainable(model: ModelInfo, inputs: PlanInputs) -> Trainable:
    lora = inputs.lora_r is not None
    lora_params, lora_largest, lora_modules = _lora_trainable(model, inputs) if lora else (0, 0, 0)
    return Trainable(
        lora=lora,
        adapter_params=lora_params,
        count=lora_params if lora else model.param_count,
        largest=lora_largest if lora else model.largest_numel,
        lora_modules=lora_modules,
        grad_bytes=4 if lora else inputs.param_bytes,  # peft keeps adapters in float32
    )


def _parameter_bytes(model: ModelInfo, inputs: PlanInputs, tr: Trainable) -> float:
    """The shard of every parameter (adapters included)."""
    return (model.param_count * inputs.param_bytes + tr.adapter_params * 4) / inputs.shard


def _optimizer_bytes(model: ModelInfo, inputs: PlanInputs, tr: Trainable) -> tuple[float, float]:
    """(the optimizer's state, its step's temporaries)."""
    shard = inputs.shard
    state_bytes = 4 if inputs.device == "cpu" or tr.lora else inputs.param_bytes
    if inputs.optimizer == "adamw":
        opt_state = 2 * tr.count * state_bytes / shard
        step_temp = ADAMW_STEP_TEMP * tr.count * state_bytes / shard
    else:
        factored = tr.adapter_params if tr.lora else sum(_adafactor_state(t.shape) for t in model.parameters)
        opt_state = factored * state_bytes / shard
        step_temp = ADAFACTOR_STEP_TEMP * tr.largest * state_bytes / shard
    if inputs.optimizer_in_backward:
        # Stepped per parameter: only the largest parameter's temporaries at once.
        step_temp = ADAFACTOR_STEP_TEMP * tr.largest * state_bytes / shard
    return opt_state, step_temp


def _gradient_bytes(inputs: PlanInputs, tr: Trainable) -> float:
    if inputs.optimizer_in_backward:
        # The hook steps and frees each gradient before autograd computes the next one.
        return tr.largest * tr.grad_bytes / inputs.shard
    return tr.count * tr.grad_bytes / inputs.shard


def _ddp_bucket_bytes(inputs: PlanInputs, tr: Trainable) -> int:
    """DDP's gradient buckets, which live as long as the model."""
    if inputs.sharded or inputs.offloaded:
        return 0
    if inputs.optimizer_in_backward:
        return tr.bytes if inputs.world_size > 1 else 0  # DDP still reduces through its buckets
    return tr.bytes  # also on one rank


def _fsdp_gather_bytes(model: ModelInfo, inputs: PlanInputs, tr: Trainable) -> int:
    """FSDP's gathered parameters and unsharded gradients, alive only through forward/backward."""
    if not (inputs.sharded or inputs.offloaded):
        return 0
    pb = inputs.param_bytes
    # trainer.parallel.build.wrap: two blocks gathered (the current one and the prefetched next) and
    # the output layer from its forward to its backward, its own unit when untied; tied, the
    # root keeps the shared embedding gathered throughout, and its unsharded gradient too.
    head = model.vocab_size * model.hidden_size
    grad_dtype = pb + (4 if inputs.device == "cuda" else 0)  # bf16 gradients reduced in fp32
    # A MoE block gathers all its experts, or with expert parallelism its E / ep of them.
    block = model.block_numel
    if model.moe is not None:
        block -= model.moe.routed_numel - model.moe.local_routed_numel(inputs.expert_parallel)
    if model.tie_word_embeddings:
        gathered = model.root_numel
        unsharded_grads = model.root_numel + block
    else:
        gathered = head
        unsharded_grads = max(head, block)
    return (gathered + 2 * block) * pb + (0 if tr.lora else unsharded_grads * grad_dtype)


def runtime_buffer_bytes(model: ModelInfo, inputs: PlanInputs) -> tuple[int, int]:
    """Buffers not in the files: (the rotary tables, the attention mask)."""
    tokens = inputs.micro_batch_size * inputs.seq_len
    rotary = tokens * (2 * model.hidden_size // model.num_heads) * 4
    mask = inputs.micro_batch_size * inputs.seq_len**2 * 1 if inputs.device == "cuda" else 0  # packed block-diagonal
    return rotary, mask


@dataclass(frozen=True)
class ActivationParts:
    """What one micro-batch of B rows leaves in memory between its forward and backward."""

    kept_per_layer: int  # what each decoder layer keeps (its block input only, checkpointed)
    working: int  # one block's backward at a time (plus its recomputed forward, checkpointed)
    final_norm: int  # the final norm's saved input and output


def activation_parts(model: ModelInfo, inputs: PlanInputs, lora_modules: int = 0) -> ActivationParts:
    """The parts of :func:`_activation_bytes` for a micro-batch of ``inputs.micro_batch_size`` rows."""
    ab = inputs.act_bytes
    tokens = inputs.micro_batch_size * inputs.seq_len
    per_layer = layer_activation_bytes(model, inputs, lora_modules)
    backward_work = tokens * ab * (BACKWARD_WORK_H * model.hidden_size + BACKWARD_WORK_I * _mlp_width(model))
    final_norm = tokens * model.hidden_size * (8 if ab == 4 else 10)
    if not inputs.gradient_checkpointing:
        return ActivationParts(per_layer, backward_work, final_norm)
    return ActivationParts(tokens * model.hidden_size * ab, per_layer + backward_work, final_norm)


def _activation_bytes(model: ModelInfo, inputs: PlanInputs, tr: Trainable, notes: list[str]) -> tuple[int, int]:
    """(activations on the device, block inputs offloaded to the host)."""
    parts = activation_parts(model, inputs, tr.lora_modules)
    if not inputs.gradient_checkpointing:
        if inputs.activation_offloading:
            notes.append("activation_offloading needs gradient_checkpointing in this estimate; ignored")
        return model.num_layers * parts.kept_per_layer + parts.working + parts.final_norm, 0
    host_offload = 0
    block_inputs = model.num_layers * parts.kept_per_layer
    if inputs.activation_offloading:
        host_offload = block_inputs
        block_inputs = 2 * parts.kept_per_layer  # the one in flight each way
    return block_inputs + parts.working + parts.final_norm, host_offload


def logit_bytes(model: ModelInfo, inputs: PlanInputs) -> int:
    ab = inputs.act_bytes
    tokens = inputs.micro_batch_size * inputs.seq_len
    vocab = model.vocab_size
    if inputs.loss_chunk_tokens:
        live = min(inputs.loss_chunk_tokens, tokens)
        return live * vocab * (ab + 4 * LOGIT_FP32_COPIES) + tokens * model.hidden_size * 4
    copies = LOGIT_FP32_COPIES + (1 if inputs.micro_batch_size > 1 else 0)  # non-contiguous shift
    return tokens * vocab * (ab + 4 * copies)


def overhead_bytes(inputs: PlanInputs) -> int:
    return CPU_RUNTIME_BYTES if inputs.device == "cpu" else GPU_WORKSPACE_BYTES


def _load_bytes(model: ModelInfo, inputs: PlanInputs, tr: Trainable, params: float, overhead: int) -> float:
    """The load phase: the parameters and the tensor being read."""
    load_transient = LOAD_TRANSIENT * model.largest_numel * inputs.param_bytes
    # FSDP ranks read only their slices of the safetensors (trainer.model.sharded_load): a 374M model's
    # rank measured 1375 MiB while loading on 2 ranks, its shard plus runtime plus this transient.
    load = params + overhead + load_transient
    mapped = model.counted_from == "safetensors" and all(t.dtype == "F32" for t in model.tensors)
    if inputs.device == "cpu" and not inputs.sharded and not tr.lora and mapped:
        # from_pretrained maps float32 safetensors and reads a page when it is first touched:
        # the weights become resident in the first step (measured: 483 MiB at the end of loading
        # the 374M model in one process, the runtime alone).
        load = overhead + load_transient
    if inputs.device == "cuda" and not (inputs.sharded or inputs.offloaded) and not inputs.optimizer_in_backward:
        load += tr.bytes  # DDP allocates its buckets when it wraps
    return load


def step_phases(inputs: PlanInputs, raw: dict[str, float], buffers: int, transient: int) -> tuple[float, float]:
    """(first step, steady state) from the unrounded components ``raw`` (``step_temp`` added),
    with ``buffers`` (held throughout) and FSDP's ``transient`` apart.

    Gradients are freed at every optimizer step (zero_grad(set_to_none=True)), so a step's
    peak is the larger of forward/backward (activations, logits, FSDP's gathers; the
    gradients too while they accumulate over micro-batches, or while each is stepped in
    backward) and the optimizer step (gradients, state, its temporaries). The first step
    allocates the state in its optimizer step; later steps hold it throughout.
    """
    grads, opt_state, step_temp = raw["gradients"], raw["optimizer_state"], raw["step_temp"]
    forward_backward = transient + raw["activations"] + raw["logits"]
    if inputs.optimizer_in_backward:
        forward_backward += grads + step_temp
    elif inputs.grad_accum > 1:
        forward_backward += grads
    resident = raw["parameters"] + buffers + raw["overhead"]
    first_step = resident + max(forward_backward, grads + opt_state + step_temp)
    steady = resident + opt_state + max(forward_backward, grads + step_temp)
    return first_step, steady


def _offload_states(inputs: PlanInputs, states: dict[str, float]) -> tuple[dict[str, float], int]:
    """With cpu_offload the states (parameters, gradients, optimizer state and the step's
    temporaries) leave the GPU for pinned host memory: (what stays on the device, host bytes)."""
    if not inputs.offloaded:
        return states, 0
    return {name: 0.0 for name in states}, int(sum(states.values()))


def nccl_buffer_bytes(inputs: PlanInputs) -> int:
    """NCCL's communicator buffers on one GPU (none on CPU, where gloo runs)."""
    if inputs.device != "cuda":
        return 0
    hierarchical = inputs.strategy.groups_by_node
    return buffer_bytes(inputs.nccl, inputs.world_size, inputs.shard, hierarchical)


def state_bytes(model: ModelInfo, inputs: PlanInputs) -> tuple[dict[str, float], Trainable]:
    """The rank's shard of the parameters, gradients and optimizer state, and the optimizer
    step's temporaries (``step_temp``); with what the optimizer trains."""
    tr = _trainable(model, inputs)
    opt_state, step_temp = _optimizer_bytes(model, inputs, tr)
    states = {
        "parameters": _parameter_bytes(model, inputs, tr),
        "gradients": _gradient_bytes(inputs, tr),
        "optimizer_state": opt_state,
        "step_temp": step_temp,
    }
    return states, tr


def estimate(model: ModelInfo, inputs: PlanInputs) -> Estimate:
    """One rank's memory for ``inputs`` (see the module docstring for the model)."""
    if inputs.strategy.pipelined:
        raise ValueError("a pipeline is estimated per position: jobgen.plan.pipeline.estimate_run")
    notes: list[str] = []
    states, tr = state_bytes(model, inputs)
    states, host_states = _offload_states(inputs, states)
    # Gradients and the buffers that hold them in flight: DDP's buckets live as long as the
    # model; FSDP's gathered parameters and unsharded gradients only through forward/backward.
    rotary, mask = runtime_buffer_bytes(model, inputs)
    buffers = _ddp_bucket_bytes(inputs, tr) + rotary + mask
    transient = _fsdp_gather_bytes(model, inputs, tr)
    activations, host_offload = _activation_bytes(model, inputs, tr, notes)
    overhead = overhead_bytes(inputs)
    raw = {
        "parameters": states["parameters"],
        "gradients": states["gradients"],
        "optimizer_state": states["optimizer_state"],
        "activations": activations,
        "logits": logit_bytes(model, inputs),
        "buffers": buffers + transient,
        "overhead": overhead,
    }
    # NCCL's buffers are not in max_memory_allocated, so not in the phases: headroom() adds them.
    components = {name: int(value) for name, value in raw.items()} | {"nccl_buffers": nccl_buffer_bytes(inputs)}
    first_step, steady = step_phases(inputs, {**raw, "step_temp": states["step_temp"]}, buffers, transient)
    load = _load_bytes(model, inputs, tr, states["parameters"], overhead)
    phases = {"load": int(load), "first_step": int(first_step), "steady": int(steady)}
    if inputs.cpu_offload and not inputs.offloaded:
        notes.append("train.cpu_offload applies to FSDP2 on GPU sites only; ignored")
    if model.moe is not None:
        notes.append(moe_note(model, inputs))
    return Estimate(components, phases, int(host_offload), tr.count, notes, host_states)


def headroom(est: Estimate, inputs: PlanInputs) -> dict[str, int]:
    """What a GPU needs beyond the predicted ``max_memory_allocated`` (nothing on CPU, where
    the figures are the measured resident set): NCCL's buffers, the CUDA context and the
    caching allocator's fragmentation, a fraction of the peak."""
    if inputs.device != "cuda":
        return {}
    return {
        "nccl_buffers": est.components.get("nccl_buffers", 0),
        "cuda_context": CUDA_CONTEXT_RESERVE,
        "fragmentation": int(FRAGMENTATION_MARGIN * est.peak),
    }


def required_bytes(est: Estimate, inputs: PlanInputs) -> int:
    """The device memory a rank needs: the peak plus :func:`headroom`."""
    return est.peak + sum(headroom(est, inputs).values())


def host_bytes_per_node(est: Estimate, inputs: PlanInputs) -> int:
    """On a GPU site with something in host memory (cpu_offload's states, offloaded
    activations): the pinned host memory of a node's ranks, each with its runtime; 0 otherwise."""
    offloaded = est.host_state_bytes + est.host_offload_bytes
    if inputs.device != "cuda" or not offloaded:
        return 0
    return inputs.ranks_per_node * (offloaded + GPU_RANK_HOST_BYTES)
