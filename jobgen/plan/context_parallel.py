"""What ``train.context_parallel = N`` adds to one rank's memory estimate.

Each rank of a group keeps ``1/N`` of every row's tokens through the whole model
(trainer/parallel/context_parallel.py), so the plan estimates activations, logits and buffers for a row
of ``ceil(max_length / 2N) * 2`` tokens (:func:`share_of_row`: the row is padded to a multiple
of 2N and cut into 2N chunks, two per rank) and then adds what attention needs of the whole row:

- the keys and values gathered from the group, ``2 x rows x max_length x kv_heads x head_dim``
  in the activations' dtype, kept by every layer for its backward (one layer's with activation
  checkpointing, whose backward gathers again);
- with SDPA (CPU, and GPUs without flex attention): one additive document-causal mask of
  ``rows x share x max_length`` in that dtype, shared by every layer; flex attention's block mask
  (GPUs with packing) is a few bytes per 128 x 128 block.
"""

from __future__ import annotations

import dataclasses
import math

from jobgen.model.files import ModelInfo
from jobgen.plan.estimate import Estimate
from jobgen.plan.inputs import PlanInputs


def share_of_row(max_length: int, ranks: int) -> int:
    """Tokens of one row each of ``ranks`` context-parallel ranks holds."""
    return 2 * math.ceil(max_length / (2 * ranks))


def gathered_bytes(model: ModelInfo, inputs: PlanInputs, max_length: int, flex: bool) -> int:
    """The gathered K/V kept for backward plus the mask, on one rank."""
    ab = inputs.act_bytes
    head_dim = model.hidden_size // model.num_heads
    per_layer = 2 * inputs.micro_batch_size * max_length * model.num_kv_heads * head_dim * ab
    layers = 1 if inputs.gradient_checkpointing else model.num_layers
    mask = 0 if flex else inputs.micro_batch_size * inputs.seq_len * max_length * ab
    return layers * per_layer + mask


def with_context_parallel(est: Estimate, model: ModelInfo, inputs: PlanInputs) -> Estimate:
    """``est`` (computed for one rank's share of each row) plus the whole row's K/V and mask,
    alive from the first forward to the end of backward: in every phase but the load."""
    ranks = inputs.mesh.cp  # the context-parallel degree of the run's layout
    if ranks == 1:
        return est
    max_length = inputs.seq_len * ranks  # the row as padded for its 2N chunks
    flex = inputs.device == "cuda" and inputs.attn_implementation == "flex_attention"
    extra = gathered_bytes(model, inputs, max_length, flex)
    components = {**est.components, "context_parallel_kv": extra}
    phases = {name: value + (extra if name != "load" else 0) for name, value in est.phases.items()}
    note = (
        f"context_parallel = {ranks}: {inputs.seq_len} of each row's {max_length} tokens per "
        "rank, plus the row's gathered keys and values" + ("" if flex else " and its attention mask")
    )
    return dataclasses.replace(est, components=components, phases=phases, notes=[*est.notes, note])
