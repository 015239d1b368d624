"""``jobgen plan`` of a mixture of experts (issue 50), without torch: Mixtral-8x7B and
gpt-oss-120b counted from their config.json alone (bench/plan_moe.py's published numbers),
their routed activations and the experts FSDP gathers per expert-parallel degree, and the plan
suggesting expert parallelism for a MoE run that does not fit. A gpt-oss checkpoint's MXFP4
experts count as the parameters the trainer dequantizes them into."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from jobgen.base.sizes import GIB
from jobgen.model.files import read_model
from jobgen.plan.estimate import estimate
from jobgen.plan.inputs import PlanInputs
from jobgen.plan.suggestions import Budgets, suggestions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from plan_moe import MODELS


def model(tmp_path: Path, name: str):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(MODELS[name]))
    return read_model(directory)


def test_the_published_moe_models_are_counted_from_config_json(tmp_path: Path):
    mixtral, oss = model(tmp_path, "Mixtral-8x7B"), model(tmp_path, "gpt-oss-120b")
    assert mixtral.param_count == 46_702_792_704  # "46.7B" on its model card
    assert oss.param_count == 116_829_156_672  # "117B" (116.83B)
    assert (mixtral.moe.experts, mixtral.moe.top_k, mixtral.moe.moe_layers) == (8, 2, 32)
    assert mixtral.moe.routed_numel == 8 * 3 * 4096 * 14336
    assert (oss.moe.experts, oss.moe.top_k, oss.moe.expert_intermediate) == (128, 4, 2880)


def test_expert_parallel_gathers_a_share_of_the_experts_and_the_plan_says_so(tmp_path: Path):
    mixtral = model(tmp_path, "Mixtral-8x7B")
    base = PlanInputs(
        device="cuda", parallelism="fsdp", world_size=8, nodes=1, seq_len=4096, gradient_checkpointing=True
    )
    whole, split = estimate(mixtral, base), estimate(mixtral, replace(base, expert_parallel=8))
    # FSDP's transient gathers: two blocks' parameters in bf16 and one block's unsharded gradient
    # (bf16, reduced in float32), each with all 8 of its experts or 1 of them.
    saved = whole.components["buffers"] - split.components["buffers"]
    assert saved == (2 * 2 + 2 + 4) * mixtral.moe.routed_numel * 7 // 8
    assert split.components["parameters"] == whole.components["parameters"]  # over the world either way
    assert split.components["activations"] > whole.components["activations"]  # the all-to-all's rows
    assert "train.expert_parallel = 8: 1 experts per rank" in split.notes[-1]
    dense_width = estimate(mixtral, replace(base, seq_len=8192)).components["activations"]
    assert dense_width > whole.components["activations"]  # routed rows grow with the tokens


def test_the_plan_suggests_expert_parallelism_for_a_moe_run_that_does_not_fit(tmp_path: Path):
    oss = model(tmp_path, "gpt-oss-120b")
    inputs = PlanInputs(
        device="cuda", parallelism="fsdp", world_size=16, nodes=2, seq_len=4096, gradient_checkpointing=True
    )
    found = suggestions(oss, inputs, Budgets(79 * GIB), 8)
    assert found and found[0].change.startswith("train.expert_parallel = "), [s.change for s in found]
    assert "all-to-all" in found[0].cost
    # Not for a strategy that cannot split experts, nor for a dense model.
    assert not any(
        "expert_parallel" in s.change
        for s in suggestions(oss, replace(inputs, parallelism="hsdp"), Budgets(79 * GIB), 8)
    )
