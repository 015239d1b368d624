"""LoRA on mixtures of experts (issue 50): its defaults never reach the routed experts, which peft
(0.21 on transformers 5) adapts as fused parameters and only without dropout, so DeepSeek-V3
crashed with the default targets and dropout; ``model.lora.target_experts`` adapts them on
purpose, without dropout. validate says which, and refuses targets peft would turn into the
experts' without it. Tiny random models of each family (tests/model_families.py), 1 process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import make_run
from jobgen.spec.loader import SpecError

pytestmark = pytest.mark.torch

MOE = ["mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "deepseek-v3", "gpt-oss", "granite-4-h"]


def _lora_model(directory: Path, **lora: object):
    from transformers import AutoModelForCausalLM

    from jobgen.spec.tables.model import ModelSpec
    from trainer.model.prep import add_lora

    spec = ModelSpec(path=str(directory), lora=lora)
    return add_lora(AutoModelForCausalLM.from_pretrained(directory), spec), spec


def _step(model) -> None:
    import torch

    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("family", MOE)
def test_the_default_targets_with_the_default_dropout_train_and_leave_the_experts(family_models, family: str):
    from jobgen.model.files import read_model
    from jobgen.model.lora_targets import adapted, weight_modules

    directory = family_models(family)
    model, spec = _lora_model(directory)
    assert spec.lora.dropout == 0.05  # the default, which peft refuses on expert parameters
    assert not [name for name, m in model.named_modules() if type(m).__name__ == "ParamWrapper"], family
    _step(model)  # DeepSeek-V3: "lora.ParamWrapper does not work with lora_dropout != 0" before the fix
    expected = adapted(None, weight_modules(read_model(directory).tensors), experts=True)
    assert sorted(model.targeted_module_names) == expected and expected, family


@pytest.mark.parametrize("family", MOE)
def test_target_experts_adapts_each_moe_layers_experts_without_dropout(family_models, family: str):
    directory = family_models(family)
    model, spec = _lora_model(directory, target_experts=True)
    assert spec.lora.dropout == 0.0
    wrapped = [name for name, m in model.named_modules() if type(m).__name__ == "ParamWrapper"]
    assert wrapped and all(".experts" in name for name in wrapped), wrapped
    _step(model)
    # lora_B starts at zero (the adapter adds nothing at first), so it is the one with a gradient.
    grads = [p.grad for name, p in model.named_parameters() if ".experts" in name and "lora_B" in name]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), family


def test_validate_says_what_lora_adapts_on_a_moe_and_refuses_what_peft_would_turn_into_experts(
    family_models, tmp_path: Path
):
    from jobgen.runs.rundir import RunDir
    from jobgen.spec.named_files import lora_adapted

    deepseek = family_models("deepseek-v3")
    run = make_run(tmp_path / "default", deepseek, "ds", model={"lora": {}})
    said = lora_adapted(RunDir(run).load_spec().run)
    assert said == (
        "kv_a_proj_with_mqa, kv_b_proj, o_proj, q_a_proj, q_b_proj (10 layers); "
        "not the routed experts of its 1 MoE layer (model.lora.target_experts)"
    )
    run = make_run(tmp_path / "experts", deepseek, "ds", model={"lora": {"target_experts": True}})
    said = lora_adapted(RunDir(run).load_spec().run)
    assert said.endswith("and the routed experts of 1 MoE layer (their fused weights)"), said

    with pytest.raises(SpecError) as refused:
        make_run(tmp_path / "named", deepseek, "ds", model={"lora": {"target_modules": ["q_a_proj", "down_proj"]}})
    (issue,) = refused.value.issues
    assert issue.key == "model.lora.target_modules[1]" and "set model.lora.target_experts = true" in issue.message
    with pytest.raises(SpecError) as refused:
        make_run(tmp_path / "regex", deepseek, "ds", model={"lora": {"target_modules": r".*mlp\..*_proj"}})
    assert "names down_proj, gate_proj, up_proj" in refused.value.issues[0].message
    with pytest.raises(SpecError) as refused:
        make_run(tmp_path / "dense", family_models("llama"), "l", model={"lora": {"target_experts": True}})
    assert refused.value.issues[0].key == "model.lora.target_experts"
    with pytest.raises(SpecError) as refused:
        make_run(tmp_path / "dropout", deepseek, "ds", model={"lora": {"target_experts": True, "dropout": 0.1}})
    assert "peft adapts the experts' fused weights only without dropout" in str(refused.value)
