"""Model directories for the memory planner and the model-file checks, without a model:
a Llama-shaped config.json and safetensors headers over holes (sparse files), so that a
374M-parameter model costs a few kilobytes of disk."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from helpers import DATA, run_spec

# A Llama-shaped model: hidden 1024, 24 layers, MLP 2816, vocab 32000, untied (374M parameters).
LLAMA = dict(hidden=1024, layers=24, inter=2816, heads=16, kv=16, vocab=32000, tied=False)


def llama_tensors(hidden, layers, inter, heads, kv, vocab, tied) -> dict[str, list[int]]:
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    if not tied:
        shapes["lm_head.weight"] = [vocab, hidden]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": [hidden, hidden],
            p + "self_attn.k_proj.weight": [kv * head_dim, hidden],
            p + "self_attn.v_proj.weight": [kv * head_dim, hidden],
            p + "self_attn.o_proj.weight": [hidden, hidden],
            p + "mlp.gate_proj.weight": [inter, hidden],
            p + "mlp.up_proj.weight": [inter, hidden],
            p + "mlp.down_proj.weight": [hidden, inter],
            p + "input_layernorm.weight": [hidden],
            p + "post_attention_layernorm.weight": [hidden],
        }
    return shapes


def write_safetensors(path: Path, shapes: dict[str, list[int]], dtype: str = "F32") -> None:
    """A safetensors file with the header only; the data is a hole (sparse file)."""
    width = {"F32": 4, "BF16": 2}[dtype]
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = width
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)


def fake_model(directory: Path, *, shards: int = 1, dtype: str = "F32", **dims) -> Path:
    dims = {**LLAMA, **dims}
    directory.mkdir(parents=True, exist_ok=True)
    shapes = llama_tensors(**dims)
    config = {
        "model_type": "llama",
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["inter"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv"],
        "vocab_size": dims["vocab"],
        "tie_word_embeddings": dims["tied"],
    }
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        write_safetensors(directory / "model.safetensors", shapes, dtype)
        return directory
    names = list(shapes)
    weight_map = {}
    for k in range(shards):
        part = {n: shapes[n] for n in names[k::shards]}
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(directory / file, part, dtype)
        weight_map |= {n: file for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def expected_count(**dims) -> int:
    total = 0
    for shape in llama_tensors(**{**LLAMA, **dims}).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def plan_spec(tmp_path: Path, model: Path, *, device_memory: str | None, **train) -> Path:
    """A run of the fake model for `jobgen plan` and submit's memory check, on a site whose
    device has ``device_memory`` (none: the site says nothing)."""
    site: dict[str, object] = {"profile": "local"}
    if device_memory:
        site["slurm"] = {"device_memory": device_memory}
    return run_spec(
        tmp_path,
        "memplan",
        site=site,
        job={"time": "1h", "runs_root": str(tmp_path / "runs")},
        model={"path": model},
        data={"path": DATA, "max_length": 512},
        train={"micro_batch_size": 1, **train},
    )
