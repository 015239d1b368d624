"""Sharded loading (trainer.model.sharded_load): FSDP ranks build the model on meta, shard it, and
read only their own slices from the safetensors.

- Every weight and buffer equals ``from_pretrained``'s, with tied embeddings still tied and
  LoRA adapters initialised, on two gloo ranks.
- A rank's memory grows by about its shard while loading, not by the whole model.
- A directory the sharded path cannot read is refused with the file and what is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import REPO, VENV_BIN, llama

pytestmark = [pytest.mark.torch]

CHECK = textwrap.dedent(
    """
    import json, resource, sys
    import torch, torch.distributed as dist
    from jobgen.spec.tables.run import TrainSpec
    from jobgen.spec.tables.model import ModelSpec
    from trainer.distributed import exit_now, init_distributed
    from trainer.parallel.build import build_model

    path, lora, out = sys.argv[1], sys.argv[2] == "lora", sys.argv[3]
    env = init_distributed(120, None)
    spec = ModelSpec(
        path=path,
        gradient_checkpointing=True,
        lora={"r": 4, "target_modules": ["q_proj", "v_proj"]} if lora else None,
    )
    torch.manual_seed(0)
    # The runtime a rank has loaded anyway (its imports) is not what loading the weights costs.
    import safetensors.torch, torch.distributed.checkpoint, transformers.models.llama.modeling_llama  # noqa
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_model(spec, TrainSpec(parallelism="fsdp"), env)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if len(sys.argv) > 4:  # memory only
        json.dump({"grown": grown}, open(f"{out}.{env.rank}", "w"))
        # Exiting with the process group alive lets gloo's threads outlive the interpreter
        # ("terminate called without an active exception", SIGABRT) now and then.
        dist.destroy_process_group()
        exit_now(0)
    sharded = type(model.get_input_embeddings().weight).__name__  # before a forward unshards the root
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.config.use_cache = False
    expected = {**ref.state_dict(), **dict(ref.named_buffers())}
    mismatched, adapters = [], {}
    for name, tensor in [*model.state_dict().items(), *model.named_buffers()]:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if "lora_" in name:
            adapters[name] = [float(full.abs().sum()), list(full.shape)]
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if not torch.equal(full, expected[key]):
            mismatched.append(name)
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        diff = float((model(input_ids=tokens).logits - ref(input_ids=tokens).logits).abs().max())
    report = {
        "mismatched": mismatched,
        "tied": model.get_input_embeddings().weight is model.get_output_embeddings().weight,
        "sharded": sharded,
        "adapters": adapters,
        "logits_max_diff": diff,
    }
    json.dump(report, open(f"{out}.{env.rank}", "w"))
    dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization for gloo's threads to abort in
    """
)


def run_check(tmp_path: Path, model: Path, mode: str, *extra: str) -> list[dict]:
    """CHECK on two gloo ranks: ``mode`` is "full" or "lora"; "memory" in ``extra`` measures only."""
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script), str(model), mode, str(out)]
    proc = subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


def tied_copy(tiny_model: Path, target: Path) -> Path:
    """The tiny model with its output embedding tied to the input embedding."""
    import shutil

    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny_model)
    config.tie_word_embeddings = True
    LlamaForCausalLM(config).save_pretrained(target)
    for file in tiny_model.glob("tokenizer*"):
        shutil.copy(file, target)
    return target


# untied in 'full' only (CI's budget): the trainer's fsdp tests load the untied tiny model this way.
@pytest.mark.parametrize("variant", [pytest.param("untied", marks=pytest.mark.full), "tied", "lora"])
def test_every_rank_loads_its_shards_equal_to_from_pretrained(tmp_path, tiny_model, variant):
    model = tied_copy(tiny_model, tmp_path / "tied") if variant == "tied" else tiny_model
    reports = run_check(tmp_path, model, "lora" if variant == "lora" else "full")
    for report in reports:
        assert report["mismatched"] == [], report
        assert report["sharded"] == "DTensor", report
        assert report["tied"] is (variant == "tied"), report
        if variant == "lora":
            assert len(report["adapters"]) == 8, report  # A and B of q_proj and v_proj in 2 layers
            a_sums = [v[0] for k, v in report["adapters"].items() if "lora_A" in k]
            b_sums = [v[0] for k, v in report["adapters"].items() if "lora_B" in k]
            assert all(s > 0 for s in a_sums) and all(s == 0 for s in b_sums), report  # peft's init
        else:
            assert report["logits_max_diff"] == 0.0, report
    if variant == "lora":
        assert reports[0]["adapters"] == reports[1]["adapters"]  # the same adapters on every rank


def test_a_rank_grows_by_its_shard_not_the_whole_model(tmp_path):
    """About 200 MB of fp32 weights: two ranks each grow by about half while loading. Loading the
    whole model on each rank first (what from_pretrained does) grows each by all of it."""
    model = llama(vocab=8000, hidden=512, inter=1536, layers=10, heads=8, kv=8)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path / "model", max_shard_size="20MB")  # several files, read by threads
    del model
    assert len(list((tmp_path / "model").glob("*.safetensors"))) > 1
    grown = [r["grown"] for r in run_check(tmp_path, tmp_path / "model", "full", "memory")]
    print(f"weights {weights / 2**20:.0f} MiB; per-rank growth while loading: {[round(g / 2**20) for g in grown]} MiB")
    assert all(g < 0.8 * weights for g in grown), (weights, grown)


def test_a_directory_without_safetensors_is_refused_with_how_to_convert(tmp_path):
    import torch

    from trainer.model.sharded_load import ShardedLoadError, read_weights

    with pytest.raises(ShardedLoadError, match=r"has no \.safetensors files.*safe_serialization=True"):
        read_weights(torch.nn.Linear(2, 2), tmp_path, threads=1)


def test_a_tensor_the_files_lack_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from trainer.model.sharded_load import ShardedLoadError, read_weights

    save_file({"weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    with pytest.raises(ShardedLoadError, match=r"lack bias"):
        read_weights(torch.nn.Linear(2, 2), tmp_path, threads=1)


def test_the_checkpoint_name_of_a_peft_parameter_is_the_base_model_name():
    from trainer.model.sharded_load import checkpoint_name, is_adapter

    name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert checkpoint_name(name) == "model.layers.0.self_attn.q_proj.weight"
    assert is_adapter("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert not is_adapter(name)
