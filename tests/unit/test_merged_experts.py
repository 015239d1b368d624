"""A mixture of experts' per-expert checkpoint tensors merged into transformers' fused parameters
(trainer/model/merged_experts.py), on one process: the plan found from the library's own
conversion mapping, the rows built for a range of experts equal to the library's conversion of
the whole layer, and a conversion of other operations refused by name. (FSDP on 2 ranks:
tests/distributed/test_family_matrix.py trains Mixtral and Qwen2-MoE with one process's losses.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

import torch
from safetensors.torch import save_file

from trainer.model.merged_experts import MergedExpertsError, expert_plans, fill_merged

EXPERTS, INTER, HIDDEN = 4, 3, 5


def _converters(model_type: str):
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    return [t for t in get_checkpoint_conversion_mapping(model_type) if isinstance(t, WeightConverter)]


def _checkpoint(tmp_path):
    torch.manual_seed(0)
    tensors = {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": torch.randn(
            (HIDDEN, INTER) if w == "w2" else (INTER, HIDDEN)
        )
        for e in range(EXPERTS)
        for w in ("w1", "w2", "w3")
    }
    save_file(tensors, tmp_path / "model.safetensors")
    return tensors


def _merged(tensors):
    gate_up, down = _converters("mixtral")
    merged = {"model.layers.0.mlp.experts.gate_up_proj": {}, "model.layers.0.mlp.experts.down_proj": {}}
    for key in tensors:
        target = "down_proj" if ".w2." in key else "gate_up_proj"
        merged[f"model.layers.0.mlp.experts.{target}"][key] = down if target == "down_proj" else gate_up
    return merged


def test_each_expert_range_is_the_librarys_conversion_of_the_whole_layer(tmp_path):
    tensors = _checkpoint(tmp_path)
    plans = {plan.name: plan for plan in expert_plans(_merged(tensors))}
    gate_up = plans["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.concat and gate_up.experts == EXPERTS and len(gate_up.sources) == 2
    assert not plans["model.layers.0.mlp.experts.down_proj"].concat
    # What the library computes for the whole layer: stack each projection's experts, then
    # concatenate gate and up along dim 1.
    stacked = [torch.stack([tensors[k] for k in keys]) for keys in gate_up.sources]
    expected = torch.cat(stacked, dim=1)
    whole = {gate_up.name: torch.zeros(EXPERTS, 2 * INTER, HIDDEN)}
    assert fill_merged(whole, [gate_up], tmp_path) == 2 * EXPERTS
    assert torch.equal(whole[gate_up.name], expected)


def test_another_conversion_is_refused_by_name(tmp_path):
    tensors = _checkpoint(tmp_path)
    merged = _merged(tensors)
    converter = next(iter(merged["model.layers.0.mlp.experts.down_proj"].values()))

    class Transpose:
        dim = 0

    # The library's converter with one more operation (its class has __slots__: a stand-in).
    odd = SimpleNamespace(source_patterns=converter.source_patterns, operations=[*converter.operations, Transpose()])
    merged["model.layers.0.mlp.experts.down_proj"] = dict.fromkeys(merged["model.layers.0.mlp.experts.down_proj"], odd)
    with pytest.raises(MergedExpertsError, match="Transpose"):
        expert_plans(merged)
