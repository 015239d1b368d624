"""Malformed or impossible model files are an error naming the file and the field (`jobgen plan`
exits 2, `jobgen submit --dry-run` refuses with the same message); a model directory with
config.json only is estimated from it for the Llama-like architectures, else refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from fake_models import fake_model, plan_spec
from helpers import jobgen
from jobgen.model.files import ModelFileError, UnsizedModel, read_model


def raw_safetensors(path: Path, header: object) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def entry(shape: object, dtype: object = "F32") -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}


# (case, how to break the model directory, what the message must name)
BROKEN = [
    ("header-list", lambda d: raw_safetensors(d / "model.safetensors", []), ("model.safetensors", "header")),
    ("entry-list", lambda d: raw_safetensors(d / "model.safetensors", {"w": [1, 2]}), ("model.safetensors", "'w'")),
    (
        "shape-string",
        lambda d: raw_safetensors(d / "model.safetensors", {"w": entry("abc")}),
        ("model.safetensors", "'w'", "shape"),
    ),
    (
        "shape-negative",
        lambda d: raw_safetensors(d / "model.safetensors", {"w": entry([-1000, 200000])}),
        ("model.safetensors", "'w'", "shape"),
    ),
    (
        "dtype-missing",
        lambda d: raw_safetensors(d / "model.safetensors", {"w": {"shape": [2, 2], "data_offsets": [0, 16]}}),
        ("model.safetensors", "'w'", "dtype"),
    ),
    ("no-tensors", lambda d: raw_safetensors(d / "model.safetensors", {}), ("model.safetensors", "no tensors")),
    ("heads-zero", lambda d: _config(d, num_attention_heads=0), ("config.json", "num_attention_heads")),
    ("hidden-string", lambda d: _config(d, hidden_size="big"), ("config.json", "hidden_size")),
    ("kv-not-dividing", lambda d: _config(d, num_key_value_heads=5), ("config.json", "num_key_value_heads")),
    ("config-list", lambda d: (d / "config.json").write_text("[1, 2]"), ("config.json", "JSON object")),
    ("config-not-json", lambda d: (d / "config.json").write_text("{oops"), ("config.json", "not JSON")),
    (
        "index-list",
        lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
        ("model.safetensors.index.json", "weight_map"),
    ),
]


def _config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("breaks, names", [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_malformed_model_is_an_error_naming_file_and_field(tmp_path: Path, breaks, names):
    model = fake_model(tmp_path / "m", layers=2)
    breaks(model)
    with pytest.raises(ModelFileError) as caught:
        read_model(model)
    for name in names:
        assert name in str(caught.value), str(caught.value)

    spec = plan_spec(tmp_path, model, device_memory="64GiB")
    plan = jobgen("plan", str(spec))
    assert plan.returncode == 2, plan.stdout + plan.stderr
    assert "Traceback" not in plan.stderr and "per rank" not in plan.stdout, plan.stdout + plan.stderr
    message = plan.stderr.strip().splitlines()[-1]
    for name in names:
        assert name in message, message

    submit = jobgen("submit", str(spec), "--dry-run")
    assert submit.returncode == 2, submit.stdout + submit.stderr
    assert "Traceback" not in submit.stderr and "not submitted" in submit.stderr, submit.stderr
    for name in names:
        assert name in submit.stderr, submit.stderr
    assert not (tmp_path / "runs" / "memplan").exists()


# Published parameter counts: TinyLlama-1.1B, Qwen2-0.5B (q/k/v biases, tied), Gemma-2B
# (explicit head_dim, tied), a Mistral of the Llama's shape.
CONFIGS = [
    (
        "llama",
        dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
        1_100_048_384,
    ),
    (
        "qwen2",
        dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
        494_032_768,
    ),
    (
        "gemma",
        dict(model_type="gemma", hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
             num_attention_heads=8, num_key_value_heads=1, head_dim=256, vocab_size=256000),
        2_506_172_416,
    ),
    (
        "mistral",
        dict(model_type="mistral", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
        1_100_048_384,
    ),
]  # fmt: skip


@pytest.mark.parametrize("config, count", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_config_only_counts_from_config_json(tmp_path: Path, config, count):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["X"], **config}))
    info = read_model(model)
    assert info.param_count == count
    assert info.counted_from == "config.json"


def test_plan_says_the_count_comes_from_config_json(tmp_path: Path):
    model = fake_model(tmp_path / "m", layers=2)
    (model / "model.safetensors").unlink()
    spec = plan_spec(tmp_path, model, device_memory="64GiB")
    plan = jobgen("plan", str(spec))
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "cannot estimate" not in plan.stdout and "fits" in plan.stdout, plan.stdout
    assert "config.json" in plan.stdout.splitlines()[0], plan.stdout
    data = json.loads(jobgen("plan", str(spec), "--json", check=True).stdout)
    assert data["param_source"] == "config.json"
    assert data["param_count"] == read_model(fake_model(tmp_path / "full", layers=2)).param_count


UNSIZED = [
    ("deepseek", {"model_type": "deepseek_v3", "n_routed_experts": 8}, "deepseek_v3"),
    ("no-model-type", {"model_type": None}, "model_type"),
    ("multimodal", {"model_type": "llava", "text_config": {"model_type": "llama"}}, "llava"),
    ("no-config", None, "config.json"),
]


@pytest.mark.parametrize("changes, reason", [c[1:] for c in UNSIZED], ids=[c[0] for c in UNSIZED])
def test_config_only_of_other_architectures_is_refused(tmp_path: Path, changes, reason):
    model = fake_model(tmp_path / "m", layers=2)
    (model / "model.safetensors").unlink()
    if changes is None:
        (model / "config.json").unlink()
    else:
        _config(model, **changes)
    with pytest.raises(UnsizedModel) as caught:
        read_model(model)
    assert reason in str(caught.value)
    plan = jobgen("plan", str(plan_spec(tmp_path, model, device_memory="64GiB")))
    assert plan.returncode != 0, plan.stdout + plan.stderr
    assert reason in plan.stderr and "Traceback" not in plan.stderr, plan.stderr
