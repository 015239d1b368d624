"""Model families beyond Llama (issue 32), as tiny random models built here (tests/model_families.py):

- the architecture is read from transformers' own class (trainer/model/architecture.py): the
  decoder layers by ``_no_split_modules`` (GPT-NeoX's GPTNeoXLayer, GPT-2's GPT2Block), the
  attention "auto" picks (eager for Gemma 2, which has no SDPA), and LoRA's default targets,
  which validate's reading of the safetensors (jobgen/model/lora_targets.py) names alike for
  every family;
- a family the parallelism cannot train is refused by the trainer with the reason before it
  loads anything, and stops the run, where validate could not see it.

Which family trains under which parallelism is tests/distributed/test_family_matrix.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import make_run, torchrun
from model_families import FAMILIES

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_validate_and_the_trainer_name_the_same_default_lora_targets(family_models, family: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from jobgen.model.files import read_model
    from jobgen.model.lora_targets import default_targets, weight_modules
    from trainer.model.architecture import Architecture

    directory = family_models(family)
    info = read_model(directory)
    from_files = default_targets(weight_modules(info.tensors), experts=bool(info.traits.experts))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    architecture = Architecture.of_model(model)
    assert from_files == architecture.lora_targets(model), family
    assert "lm_head" not in from_files and "gate" not in from_files
    assert len(architecture.decoder_layers(model)) == 2, family  # every family's blocks are found


def test_what_the_architecture_says_of_gemma2_gpt_neox_phi3_and_mixtral(family_models):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model.architecture import Architecture

    def architecture(family: str) -> tuple[Architecture, torch.nn.Module]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(family_models(family)))
        return Architecture.of_model(model), model

    gemma2, _ = architecture("gemma2")
    assert gemma2.attention("auto", gpu=False, packing=True) == ("eager", "Gemma2ForCausalLM does not support SDPA")
    assert gemma2.attention("sdpa", gpu=False, packing=True)[0] == "sdpa"  # what the user asked for stands
    assert gemma2.tied_embeddings
    neox, model = architecture("gpt-neox")
    assert neox.layer_classes == ("GPTNeoXLayer",) and neox.attention("auto", gpu=False, packing=False)[0] == "sdpa"
    assert neox.lora_targets(model) == ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"]
    phi3, model = architecture("phi3")
    assert phi3.lora_targets(model) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]  # fused, all of them
    mixtral, model = architecture("mixtral")
    assert mixtral.experts == 4 and mixtral.lora_targets(model) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def losses(run: Path) -> list[float]:
    return [
        line["loss"] for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in line
    ]


def test_a_family_the_parallelism_cannot_train_stops_the_run_with_the_reason(tmp_path: Path, family_models):
    """validate refuses it (tests/distributed/test_family_matrix.py); the trainer too, before it
    loads anything, for a model validate could not read: here a Llama's directory whose files a
    teammate replaced by Granite 4.0-H's (Mamba layers) after the pipelined run was submitted."""
    model = tmp_path / "model"
    shutil.copytree(family_models("llama"), model)
    pipeline = {"schedule": "1f1b", "microbatches": 2}
    run = make_run(tmp_path, model, "swapped", parallelism="pipeline", pipeline=pipeline, max_steps=3)
    shutil.rmtree(model)
    shutil.copytree(family_models("granite-4-h"), model)
    proc = torchrun(run, nproc=2, timeout=400)
    assert proc.returncode != 0
    marker = json.loads((run / "failed").read_text())
    assert marker["reason"].startswith("ModelError: train.parallelism = 'pipeline': "), marker
    assert "Mamba scans" in marker["reason"] and "train it with train.parallelism = 'ddp'" in marker["reason"]


@pytest.mark.parametrize(
    ("family", "reason"),
    [("granite-4-h", "sequence mixers that are no attention (Mamba scans"), ("gpt-oss", "learned sinks")],
)
def test_context_parallel_refuses_a_model_it_cannot_split_in_validate_and_in_the_trainer(
    tmp_path: Path, family_models, family: str, reason: str
):
    """Granite 4.0-H's Mamba layers under context parallelism ran each rank's share of a row as a
    whole row, a loss off by 2e-5 on the tiny model: silently wrong. gpt-oss's sinks failed at
    the first forward. Both are refused before anything queues, and by the trainer for a model
    validate could not read (a hub id)."""
    from jobgen.spec.loader import SpecError
    from jobgen.spec.tables.model import ModelSpec
    from jobgen.spec.tables.run import TrainSpec
    from trainer.model.build import refuse_unsupported
    from trainer.model.errors import ModelError

    model = family_models(family)
    with pytest.raises(SpecError) as refused:
        make_run(tmp_path, model, "cp", parallelism="fsdp", context_parallel=2)
    (issue,) = [issue for issue in refused.value.issues if reason in issue.message]  # beside the 1-process world's
    assert issue.key == "train.context_parallel" and str(model) in issue.message
    assert "train.context_parallel = 1 (ddp, fsdp or hsdp; expert_parallel for its experts)" in issue.message
    train = TrainSpec(parallelism="fsdp", context_parallel=2, max_steps=1)
    with pytest.raises(ModelError) as stopped:
        refuse_unsupported(ModelSpec(path=str(model)), train)
    assert str(stopped.value).startswith(f"train.context_parallel = 2: {model}: ") and reason in str(stopped.value)
    refuse_unsupported(ModelSpec(path=str(model)), TrainSpec(parallelism="fsdp", max_steps=1))  # cp 1 trains
