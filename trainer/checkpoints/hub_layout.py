"""The names and tensors an export writes, in the layout the base model's own files have.

transformers 5 holds some weights under other names, or merged, than its checkpoints store them
(``transformers.conversion_mapping``): Mixtral's ``block_sparse_moe`` is ``mlp`` in memory, and
a layer's experts are one fused parameter (``mlp.experts.gate_up_proj``) where the files keep
one tensor per expert and projection (``block_sparse_moe.experts.3.w1.weight``). The trainer's
checkpoints hold the in-memory names. An export writes what the base model's files hold, as
``save_pretrained`` does: the renames reverted, each fused parameter split back into its
experts' tensors, so that every export of a model has one layout (a LoRA merge streams the base
files and keeps theirs anyway) and tools that read the hub's layout (vLLM, older transformers)
read it.

    layout = HubLayout.of(skeleton, base_tensors)     # base_tensors: name -> (shape, dtype)
    for name in saved_names: layout.outputs(name)     # [(file name, expert, projection)]
    layout.part(fused_tensor, expert, projection, name)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from trainer.model.architecture import CheckpointLayout
from trainer.model.merged_experts import ExpertMerge, expert_plans
from trainer.model.mxfp4 import BLOCKS, SCALES, mxfp4_plans, quantize

MXFP4_PARTS = (BLOCKS, SCALES)  # quantize()'s (blocks, scales), as the files name them


@dataclass(frozen=True)
class Output:
    """One tensor the export writes: its name in the files, and where it comes from in the
    checkpoint's tensor (the whole tensor, or one expert's projection of a fused one)."""

    name: str
    shape: tuple[int, ...]
    expert: int | None = None
    projection: int = 0
    quantized: str | None = None  # "blocks" or "scales": an MXFP4 part of the whole tensor


class HubLayout:
    """In-memory name -> the tensors the base model's files hold for it."""

    def __init__(
        self,
        renamed: dict[str, str],
        experts: dict[str, ExpertMerge],
        shapes: Mapping[str, tuple],
        quantized: frozenset[str] = frozenset(),
    ):
        self.renamed = renamed
        self.experts = experts
        self.shapes = shapes  # the base files' tensor shapes
        self.quantized = quantized  # in-memory names written as MXFP4 blocks and scales
        # The last tensor quantized: its blocks and its scales are two outputs, read one after
        # the other, and quantizing a layer's experts once is enough.
        self._last_quantized: tuple[str, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def of(
        cls,
        skeleton: torch.nn.Module,
        base_tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        keep_quantization: bool = False,
    ):
        """From the model (its conversion mapping) and the base model's files' tensors;
        ``keep_quantization``: the weights those files hold in MXFP4 (gpt-oss's experts) are
        written so again (model.export_quantization = "base")."""
        renamed, merged = CheckpointLayout(skeleton).resolve(base_tensors)
        experts = {plan.name: plan for plan in expert_plans(merged)}
        shapes = {name: shape for name, (shape, _) in base_tensors.items()}
        quantized = (
            frozenset(mxfp4_plans(list(skeleton.state_dict()), set(base_tensors))) if keep_quantization else frozenset()
        )
        return cls(renamed, experts, shapes, quantized)

    @classmethod
    def as_in_memory(cls) -> HubLayout:
        """Every tensor under its in-memory name (no base files to follow)."""
        return cls({}, {}, {})

    def outputs(self, name: str, shape: tuple[int, ...]) -> list[Output]:
        """What the files hold of the in-memory tensor ``name`` (of ``shape``)."""
        if name in self.quantized:
            return [
                Output(name + suffix, tuple(self.shapes[name + suffix]), quantized=suffix) for suffix in MXFP4_PARTS
            ]
        plan = self.experts.get(name)
        if plan is None:
            return [Output(self.renamed.get(name, name), shape)]
        return [
            Output(key, tuple(self.shapes[key]), expert, projection)
            for expert in range(plan.experts)
            for projection, per_expert in enumerate(plan.sources)
            for key in (per_expert[expert],)
        ]

    def part(self, tensor: torch.Tensor, output: Output, name: str) -> torch.Tensor:
        """``output``'s tensor cut from the in-memory ``tensor`` of ``name``: the tensor itself,
        or one expert's row, split into its projections as they were concatenated, or its MXFP4
        blocks or scales."""
        if output.quantized is not None:
            last = self._last_quantized
            if last is None or last[0] != name or last[1] is not tensor:
                last = self._last_quantized = (name, tensor, quantize(tensor))
            return last[2][MXFP4_PARTS.index(output.quantized)]
        if output.expert is None:
            return tensor
        plan = self.experts[name]
        row = tensor[output.expert]
        if not plan.concat:
            return row
        sizes = [self.shapes[per_expert[output.expert]][0] for per_expert in plan.sources]
        return row.split(sizes, dim=0)[output.projection]
