"""``jobgen export`` streams: sharded safetensors written tensor by tensor from the DCP checkpoint.

What is proved here, on the trainer's own checkpoints (``torchrun`` with 2 processes)
or on checkpoints written directly with ``dcp.save``:

- full fine-tuning (DDP and FSDP2) exports as several shards plus the index, loads with
  ``from_pretrained`` and equals the checkpoint, tensor by tensor;
- LoRA exports as a peft adapter directory equal to the trained adapters, and
  ``--merge-lora`` equals what peft's ``merge_and_unload`` makes of base + adapters;
- tied embeddings are written once, as save_pretrained writes them;
- a checkpoint that breaks half-way through the export leaves nothing of itself behind;
- memory: the export's peak RSS grows by a bounded batch, not by the model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import REPO, checkpoint_tensors, make_run, torchrun

pytestmark = [pytest.mark.torch]

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _export(run: Path, target: Path, **kwargs):
    from jobgen.runs.rundir import RunDir
    from trainer.checkpoints.export import export

    lines: list[str] = []
    source = export(RunDir(run).load_spec(), run, target, report=lines.append, **kwargs)
    return source, lines


def _shards(target: Path) -> list[str]:
    index = json.loads((target / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(p.name for p in target.glob("model-*.safetensors"))
    assert not (target / "model.safetensors").exists()
    from safetensors.torch import load_file

    on_disk = {name: file for file in files for name in load_file(target / file)}  # each file is valid safetensors
    assert on_disk == index["weight_map"]
    sizes = sum(t.numel() * t.element_size() for file in files for t in load_file(target / file).values())
    assert index["metadata"]["total_size"] == sizes
    return files


# ---------------------------------------------------------------- full fine-tuning


# ddp in 'full' only (CI's budget): fsdp's checkpoint is the sharded one, ddp's differs only in who wrote it.
@pytest.mark.parametrize("parallelism", [pytest.param("ddp", marks=pytest.mark.full), "fsdp"])
def test_full_export_is_sharded_and_equals_the_checkpoint(tmp_path, tiny_model, parallelism):
    import torch
    from transformers import AutoModelForCausalLM

    # A narrower dtype than training's, asked for: every weight rounded once, nothing else changed.
    run = make_run(tmp_path, tiny_model, parallelism=parallelism, max_steps=2, model={"export_dtype": "bfloat16"})
    proc = torchrun(run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    target = tmp_path / "exported"
    source, _ = _export(run, target, max_shard_bytes=64 * 1024, batch_bytes=16 * 1024)
    assert source.name == "step-00000002"
    assert len(_shards(target)) >= 2
    assert (target / "jobgen_export.txt").read_text().endswith("checkpoint step-00000002\n")
    config = json.loads((target / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["use_cache"] is True

    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.dtype == torch.bfloat16
    exported = model.state_dict()
    trained = checkpoint_tensors(source)
    assert set(exported) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base[q], trained[q])  # trained: the export is not the base model


# ---------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model) -> Path:
    """One short LoRA run (float32, so a merge is compared at float32 precision)."""
    pytest.importorskip("peft")
    run = make_run(tmp_path_factory.mktemp("lora"), tiny_model, max_steps=3, model={"dtype": "float32", "lora": LORA})
    proc = torchrun(run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def _peft_with_checkpoint(tiny_model: Path, checkpoint: Path):
    """The reference: the base model with the run's adapters put in by peft itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    config = LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"], task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, config)
    adapters = checkpoint_tensors(checkpoint)
    params = dict(model.named_parameters())
    assert adapters and all("lora_" in name for name in adapters)
    for name, tensor in adapters.items():
        params[name].data.copy_(tensor)
    return model, adapters


def test_lora_adapter_export_loads_with_peft_and_equals_the_trained_adapters(tmp_path, tiny_model, lora_run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    target = tmp_path / "adapter"
    source, _ = _export(lora_run, target)
    assert (target / "adapter_config.json").exists() and (target / "adapter_model.safetensors").exists()
    assert not list(target.glob("model*.safetensors"))
    config = json.loads((target / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model) and config["r"] == LORA["r"]

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), target)
    params = dict(loaded.named_parameters())
    adapters = checkpoint_tensors(source)
    for name, tensor in adapters.items():
        assert torch.equal(params[name], tensor), name
    assert any(float(t.abs().max()) > 0 for n, t in adapters.items() if "lora_B" in n)  # trained, not the zero init


def test_merged_lora_export_equals_peft_merge_and_unload(tmp_path, tiny_model, lora_run):
    import torch
    from transformers import AutoModelForCausalLM

    target = tmp_path / "merged"
    source, _ = _export(lora_run, target, merge_lora=True, max_shard_bytes=64 * 1024, batch_bytes=16 * 1024)
    assert len(_shards(target)) >= 2
    reference, _ = _peft_with_checkpoint(tiny_model, source)
    expected = reference.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(target).state_dict()
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert merged[name].dtype == torch.float32
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((merged[q] - base[q]).abs().max()) > 1e-6  # the adapters were merged in


# ---------------------------------------------------------------- checkpoints written directly


def _model_with_checkpoints(directory: Path, tiny_model: Path, steps: int = 1, **config: object) -> tuple[Path, Path]:
    """A random Llama saved as a model directory (with the tiny model's tokenizer) and a run
    whose checkpoints step-1..step-N hold its weights plus N-1, as the trainer writes them."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    model = LlamaForCausalLM(LlamaConfig(**{**settings, "vocab_size": 512, "eos_token_id": 2, **config}))
    model_dir = directory / "model"
    model.save_pretrained(model_dir)
    for path in tiny_model.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(path, model_dir / path.name)
    run = make_run(directory, model_dir, max_steps=steps)
    for step in range(1, steps + 1):
        state = {"model": {k: v + (step - 1) for k, v in model.state_dict().items()}}
        dcp.save(state, checkpoint_id=str(run / "checkpoints" / f"step-{step:08d}"), no_dist=True)
    return model_dir, run


def test_tied_embeddings_are_written_once(tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    _, run = _model_with_checkpoints(tmp_path, tiny_model, tie_word_embeddings=True)
    target = tmp_path / "exported"
    _export(run, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert "model.embed_tokens.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    trained = checkpoint_tensors(run / "checkpoints" / "step-00000001")
    # model.export_dtype 'base': the base model's float32, whatever model.dtype says (bfloat16).
    assert model.dtype == torch.float32 == trained["model.embed_tokens.weight"].dtype
    assert torch.equal(model.model.embed_tokens.weight, trained["model.embed_tokens.weight"])


def test_a_checkpoint_that_breaks_mid_export_leaves_nothing_of_itself(tmp_path, tiny_model, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from trainer.checkpoints.export import ExportError
    from trainer.checkpoints.hf_shards import DcpTensors

    _, run = _model_with_checkpoints(tmp_path, tiny_model, steps=2)
    shard = run / "checkpoints" / "step-00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # the first tensors still read
    read_from: list[str] = []
    real_read = DcpTensors.read

    def counting_read(self, keys):
        got = real_read(self, keys)
        read_from.append(self.path.name)
        return got

    monkeypatch.setattr(DcpTensors, "read", counting_read)
    target = tmp_path / "exported"
    source, lines = _export(run, target, max_shard_bytes=32 * 1024, batch_bytes=8 * 1024)
    assert source.name == "step-00000001"
    assert "step-00000002" in read_from  # it broke half-way, after batches of it were written
    assert any(line.startswith("skipped step-00000002") for line in lines), lines
    files = _shards(target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert all(name.endswith(f"-of-{len(files):05d}.safetensors") for name in files)  # no file of the other plan
    trained = checkpoint_tensors(run / "checkpoints" / "step-00000001")
    written = {name: t for file in files for name, t in load_file(target / file).items()}
    assert set(written) == set(index["weight_map"])
    for name, tensor in written.items():
        assert torch.equal(tensor, trained[name]), name
    # Named, the broken one is an error, and nothing is left next to the target.
    with pytest.raises(ExportError, match="step-00000002 could not be loaded"):
        _export(run, tmp_path / "again", checkpoint="step-00000002", batch_bytes=8 * 1024)
    assert not (tmp_path / "again").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".staging")]


# ---------------------------------------------------------------- memory

MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from jobgen.runs.rundir import RunDir
    from trainer.checkpoints import export as exporting
    from trainer.model.build import load_tokenizer

    def peak_kib():
        # VmHWM, this process's own high-water mark: ru_maxrss would start at the parent's
        # peak (Linux carries it over fork and exec), pytest's here, and hide the export's.
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    run, target, batch = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    spec = RunDir(run).load_spec()
    exporting._skeleton(spec.run.model)  # imports and the config: what any export costs, whatever its size
    load_tokenizer(spec.run.model.path)
    before = peak_kib()
    exporting.export(spec, run, target, max_shard_bytes=4 * batch, batch_bytes=batch)
    after = peak_kib()
    print(json.dumps({"before_kib": before, "after_kib": after}))
    """
)


def test_export_memory_grows_by_a_batch_not_by_the_model(tmp_path, tiny_model):
    """A 128 MiB (float32) model exported in 8 MiB batches. Loading it whole, as the export
    did before, grows the peak RSS by about 200 MiB (the float32 model, then its bfloat16
    copy); streamed, by about 40 MiB (a batch, plus the 16 MiB embedding matrix read as
    one tensor and its bfloat16 copy)."""
    model_dir, run = _model_with_checkpoints(
        tmp_path, tiny_model, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, vocab_size=8000
    )
    weights = (model_dir / "model.safetensors").stat().st_size
    assert weights > 120 * 2**20
    target = tmp_path / "exported"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(run), str(target), str(8 * 2**20)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = (rss["after_kib"] - rss["before_kib"]) * 1024
    print(f"export peak RSS growth {growth / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights")
    assert growth < weights / 2 + 32 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB"
    assert len(_shards(target)) >= 2
