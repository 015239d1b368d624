"""What jobgen reads of an architecture without torch (jobgen/model/traits.py), against
transformers' own classes and configs:

- the families whose class lacks SDPA or flex attention, by model_type, are those of the
  installed transformers (the plan sizes "auto" by them: Gemma 2's eager attention);
- tied embeddings and experts are read from config.json as the trainer reads them from the
  loaded config;
- the table of parallelisms refuses by them with one text, naming what can train the model.
"""

from __future__ import annotations

import pytest

from jobgen.model.parallelism import STRATEGIES
from jobgen.model.traits import WITHOUT_FLEX, WITHOUT_SDPA, ModelTraits

# The families of the model-family matrix (tests/model_families.py) and others users fine-tune,
# some with a kernel missing: loading every causal LM class transformers has would cost the
# suite several seconds for families nobody here trains.
CHECKED = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "gpt_neox",
    "gpt2",
    "mixtral",
    "qwen2_moe",
    "gpt_neo",
    "bloom",
    "falcon",
    "mpt",
    "stablelm",
    "olmoe",
    "gpt_bigcode",
    "starcoder2",
    "phi",
    "cohere",
    "granite",
]


@pytest.mark.parametrize("model_type", CHECKED)
def test_the_kernel_tables_are_those_of_the_installed_transformers(model_type: str):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    cls = AutoModelForCausalLM._model_mapping._load_attr_from_module(model_type, name)
    assert (model_type in WITHOUT_SDPA) == (not cls._supports_sdpa)
    assert (model_type in WITHOUT_FLEX) == (not cls._supports_flex_attn)


def traits(model_type: str, tied=False, **config) -> ModelTraits:
    return ModelTraits.of_config({"model_type": model_type, **config}, tied=tied)


def test_what_the_config_and_the_tensor_names_say():
    assert traits("mixtral", num_local_experts=8).experts == 8 and traits("llama").experts == 0
    nested = ModelTraits.of_config({"model_type": "x", "text_config": {"model_type": "y", "num_experts": 4}}, tied=True)
    assert (nested.model_type, nested.experts, nested.tied_embeddings) == ("y", 4, True)
    assert traits("gemma2").attention("auto", gpu=True, packing=False) == "eager"  # no SDPA (flex it has)
    assert traits("gemma2").attention("auto", gpu=True, packing=True) == "flex_attention"
    assert traits("gpt2").attention("auto", gpu=True, packing=True) == "sdpa"
    assert traits("llama").attention("auto", gpu=True, packing=True) == "flex_attention"
    assert traits("gemma2").attention("sdpa", gpu=False, packing=False) == "sdpa"  # asked for: stands


def test_a_refusal_names_the_parallelisms_that_can_train_the_model():
    pipeline, fsdp = STRATEGIES["pipeline"], STRATEGIES["fsdp"]
    assert pipeline.model_refusal(traits("llama")) is None
    assert pipeline.model_refusal(traits("llama", tied=True)) is None  # a copy on the last stage
    moe = traits("mixtral", num_local_experts=4)
    assert fsdp.model_refusal(moe) is None and STRATEGIES["ddp"].model_refusal(moe) is None
    assert pipeline.model_refusal(moe) is None
    hybrid = pipeline.model_refusal(traits("granitemoehybrid", num_local_experts=4))
    assert "Mamba scans" in hybrid and hybrid.endswith("= 'ddp' or 'fsdp' or 'hsdp'")
    assert "not 'cohere'" in pipeline.model_refusal(traits("cohere"))
    # The router's auxiliary loss, which the stages do not collect: refused rather than dropped.
    aux = traits("mixtral", num_local_experts=4, output_router_logits=True, router_aux_loss_coef=0.02)
    assert "router's auxiliary loss" in pipeline.model_refusal(aux) and fsdp.model_refusal(aux) is None
