"""gpt-oss as published (issue 50): its experts in MXFP4 (``*_blocks`` and ``*_scales``, as
transformers reads them), dequantized to the training dtype as the sharded load reads them,
each rank only its own experts (trainer/model/mxfp4.py). A tiny MXFP4 checkpoint is written
here from a float model.

- the dequantization is transformers' own, value for value;
- FSDP on 2 gloo ranks trains with the losses of one process that loads the model through
  ``from_pretrained`` (which dequantizes it itself), and so does expert parallelism;
- the export, dequantized, loads with ``from_pretrained`` equal to the checkpoint; with
  ``model.export_quantization = "base"`` the experts are written as MXFP4 again, in the
  published model's layout, and load as the checkpoint's weights rounded to their FP4 steps.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from helpers import checkpoint_tensors, losses, make_run, summary, torchrun_many
from model_families import make_family_model

pytestmark = pytest.mark.torch

STEPS = 3
BATCH = {"max_steps": STEPS, "micro_batch_size": 2, "global_batch_size": 4, "warmup_steps": 1}
KEPT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_mxfp4(model: Path, target: Path) -> Path:
    """``model`` (a float gpt-oss) with its experts' weights as MXFP4 blocks and scales, and
    config.json's quantization_config as the published gpt-oss has it."""
    from safetensors.torch import load_file, save_file

    from trainer.model.mxfp4 import quantize

    shutil.copytree(model, target)
    (weights,) = target.glob("*.safetensors")
    tensors = load_file(weights)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize(tensors.pop(name))
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": KEPT}
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mxfp4")
    return write_mxfp4(make_family_model(root / "float", "gpt-oss"), root / "gpt-oss-mxfp4")


def test_the_dequantized_experts_are_what_transformers_loads(mxfp4_model: Path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from trainer.model.mxfp4 import dequantize, quantize

    loaded = AutoModelForCausalLM.from_pretrained(
        mxfp4_model, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    (weights,) = mxfp4_model.glob("*.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    with safe_open(weights, framework="pt") as files:
        blocks, scales = files.get_tensor(name + "_blocks"), files.get_tensor(name + "_scales")
    ours = dequantize(blocks, scales, torch.float32)
    assert torch.equal(ours, loaded.get_parameter(name).detach())
    again = quantize(ours)  # exactly representable values quantize to the same bytes
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)


def test_an_mxfp4_gpt_oss_trains_under_fsdp_and_expert_parallel_and_exports_a_model_that_loads(
    mxfp4_model: Path, tmp_path: Path
):
    import torch
    from transformers import AutoModelForCausalLM

    from jobgen.runs.rundir import RunDir
    from trainer.checkpoints.export import export

    fsdp = make_run(tmp_path / "fsdp", mxfp4_model, "fsdp", parallelism="fsdp", **BATCH)
    split = make_run(tmp_path / "ep", mxfp4_model, "ep", procs=2, parallelism="fsdp", expert_parallel=2, **BATCH)
    one = make_run(tmp_path / "one", mxfp4_model, "one", parallelism="ddp", **BATCH)
    for nproc, runs in ((2, [fsdp, split]), (1, [one])):
        proc = torchrun_many(runs, nproc=nproc)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    expected = losses(one)
    for run in (fsdp, split):
        assert summary(run)["end_step"] == STEPS
        got = losses(run)
        for step, loss in expected.items():
            assert got[step] == pytest.approx(loss, rel=1e-4), (run.name, step, got, expected)

    source = export(RunDir(fsdp).load_spec(), fsdp, tmp_path / "exported", report=lambda line: None).name
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert "quantization_config" not in config  # written as it trained
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    trained = checkpoint_tensors(fsdp / "checkpoints" / source)
    exported = model.state_dict()
    assert set(exported) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name

    # model.export_quantization = "base": the experts as MXFP4 again, as the published model has them.
    keep = RunDir(fsdp).load_spec()
    model_spec = keep.run.model.model_copy(update={"export_quantization": "base"})
    keep = dataclasses.replace(keep, run=keep.run.model_copy(update={"model": model_spec}))
    export(keep, fsdp, tmp_path / "quantized", report=lambda line: None, checkpoint=source)
    config = json.loads((tmp_path / "quantized" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert _tensor_names(tmp_path / "quantized") == _tensor_names(mxfp4_model)  # the base model's layout
    from transformers import Mxfp4Config

    from trainer.model.mxfp4 import dequantize, quantize

    requantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "quantized", quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).state_dict()
    for name, tensor in trained.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert torch.equal(requantized[name], dequantize(*quantize(tensor), torch.float32)), name
        else:
            assert torch.equal(requantized[name], tensor), name


def _tensor_names(directory: Path) -> set[str]:
    from jobgen.model.files import read_model

    return {tensor.name for tensor in read_model(directory).tensors}
