"""A mixture of experts' fused parameters filled, shard by shard, from a checkpoint that stores
each expert apart.

The hub's checkpoints (and ``save_pretrained``) keep one tensor per expert and projection
(Mixtral's ``block_sparse_moe.experts.3.w1.weight``); transformers 5 holds all of a layer's
experts in one parameter (``mlp.experts.gate_up_proj``: ``[experts, 2 x intermediate,
hidden]``) and converts as it loads, by the model's conversion mapping
(``transformers.conversion_mapping``): stack the experts (``MergeModulelist(dim=0)``), then,
for gate and up, concatenate the two projections (``Concatenate(dim=1)``).

FSDP shards such a parameter on its first dimension, the experts: each rank reads the
tensors of *its* experts only, builds its rows exactly as the library's two operations would,
and copies them into its shard. A rank holds its shard plus one expert's tensors being read,
never the layer's experts. A conversion made of other operations is refused by name.

    plans = expert_plans(merged)          # from CheckpointLayout.resolve
    fill_merged(model_state, plans, directory)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.model.errors import ModelError


class MergedExpertsError(ModelError):
    """The checkpoint's per-expert tensors cannot be merged as the model asks; the message says why."""


@dataclass(frozen=True)
class ExpertMerge:
    """How one fused parameter is made of the checkpoint's tensors: ``sources[p][e]`` is the
    key of projection ``p`` (in the converter's order) of expert ``e``; ``concat`` whether
    the projections are concatenated along their output rows (gate_up) or there is one."""

    name: str
    sources: tuple[tuple[str, ...], ...]
    concat: bool

    @property
    def experts(self) -> int:
        return len(self.sources[0])


def _operations(converter) -> bool:
    """Whether ``converter``'s operations concatenate after stacking; MergedExpertsError for any
    other sequence than the two this module reproduces."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", ())]
    if ops == [("MergeModulelist", 0)]:
        return False
    if ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
        return True
    raise MergedExpertsError(
        f"the checkpoint's {', '.join(converter.source_patterns)} are converted by {ops}, which the sharded "
        "load does not reproduce: train this model with train.parallelism = 'ddp'"
    )


def expert_plans(merged: dict[str, dict[str, object]]) -> list[ExpertMerge]:
    """One plan per fused parameter, from its checkpoint keys and the converter that merges them
    (``{name: {checkpoint key: converter}}``, as CheckpointLayout.resolve finds them)."""
    plans = []
    for name, keys in sorted(merged.items()):
        converters = {id(c): c for c in keys.values()}
        if len(converters) != 1:
            raise MergedExpertsError(f"{name} is merged by {len(converters)} conversions of the library")
        converter = next(iter(converters.values()))
        concat = _operations(converter)
        patterns = [
            re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + "$") for pattern in converter.source_patterns
        ]
        found: list[dict[int, str]] = [{} for _ in patterns]
        for key in keys:
            for index, pattern in enumerate(patterns):
                match = pattern.search(key)
                if match:
                    found[index][int(match[1])] = key
                    break
        counts = {len(per_expert) for per_expert in found}
        if len(counts) != 1 or any(sorted(per) != list(range(len(per))) for per in found):
            numbers = [sorted(per) for per in found]
            raise MergedExpertsError(f"{name}: the checkpoint's experts {numbers} are not numbered 0..n-1 alike")
        sources = tuple(tuple(per[e] for e in range(len(per))) for per in found)
        plans.append(ExpertMerge(name, sources, concat))
    return plans


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {key: directory / file for key, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    where = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), file))
    return where


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """This rank's part of ``tensor`` (a DTensor shard, or the whole tensor) and the experts it
    covers: (local tensor, first expert, experts)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, 0, tensor.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):  # every placement but Shard(0) would land here
        raise MergedExpertsError(f"a shard of {tuple(local.shape)} where {tuple(shape)} was expected")
    if any(offset[1:]):
        raise MergedExpertsError("fused experts sharded on a dimension other than the experts'")
    return local, offset[0], shape[0]


def fill_merged(tensors: dict[str, torch.Tensor], plans: list[ExpertMerge], directory: Path) -> int:
    """Copy into each ``tensors[plan.name]`` (a parameter, sharded on its experts) the rows of
    this rank's experts, read from ``directory``'s safetensors one expert at a time. Returns the
    checkpoint tensors read."""
    from safetensors import safe_open

    where = checkpoint_files(directory)
    read = 0
    for plan in plans:
        local, first, count = local_rows(tensors[plan.name])
        if local.shape[0] == 0:
            continue
        for row in range(count):
            expert = first + row
            parts = []
            for per_expert in plan.sources:
                key = per_expert[expert]
                with safe_open(where[key], framework="pt") as handle:
                    parts.append(handle.get_tensor(key))
                read += 1
            merged = torch.cat(parts, dim=0) if plan.concat else parts[0]
            copy_expert(local, row, merged, f"{plan.name}: expert {expert} of the checkpoint")
    return read


def copy_expert(local: torch.Tensor, row: int, tensor: torch.Tensor, what: str) -> None:
    """``tensor`` into this rank's ``local[row]`` (one expert), MergedExpertsError naming
    ``what`` when its shape is not the model's."""
    if tuple(tensor.shape) != tuple(local.shape[1:]):
        raise MergedExpertsError(f"{what} is {tuple(tensor.shape)}, the model's is {tuple(local.shape[1:])}")
    with torch.no_grad():
        local[row].copy_(tensor)
