"""What a model directory holds, read without torch: every tensor's name, dtype and shape from
the safetensors headers, and the dimensions from ``config.json``.

The headers are read as bytes (8-byte little-endian length, then a JSON header of
``{name: {dtype, shape, data_offsets}}``); the tensors' data is never read.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobgen.sizes import MIB

SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


class PlanError(ValueError):
    """The model's files cannot be read for an estimate; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelInfo:
    """Every tensor in the model's safetensors and the dimensions from its config.json."""

    directory: str
    tensors: tuple[TensorInfo, ...]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def param_count(self) -> int:
        return sum(t.numel for t in self.parameters)

    @property
    def parameters(self) -> list[TensorInfo]:
        """The tensors that are parameters of the model: a tied head stored twice counts once."""
        names = {t.name for t in self.tensors}
        tied_head = self.tie_word_embeddings and any(n.endswith("embed_tokens.weight") for n in names)
        return [t for t in self.tensors if not (tied_head and t.name.endswith("lm_head.weight"))]

    @property
    def largest_numel(self) -> int:
        return max((t.numel for t in self.parameters), default=0)

    def layer_numels(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self.parameters:
            match = _LAYER.search(t.name)
            if match:
                out[int(match[1])] = out.get(int(match[1]), 0) + t.numel
        return out

    @property
    def block_numel(self) -> int:
        return max(self.layer_numels().values(), default=0)

    @property
    def root_numel(self) -> int:
        """Parameters outside the decoder blocks (embeddings, final norm, head)."""
        return self.param_count - sum(self.layer_numels().values())


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file (the tensors' data is not read)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise PlanError(f"{path}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > 100 * MIB:
                raise PlanError(f"{path}: header length {length} is not plausible")
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise PlanError(f"{path}: cannot read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path}: the safetensors header is not JSON ({exc})") from None
    header.pop("__metadata__", None)
    return header


def read_model(directory: str | Path) -> ModelInfo:
    """Shapes from the safetensors headers (one file or the shards of model.safetensors.index.json)
    and dimensions from config.json; raises PlanError when they cannot be read."""
    root = Path(directory)
    if not root.is_dir():
        raise PlanError(f"{directory} is not a local directory (a hub id is not looked up)")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise PlanError(f"{index}: cannot read the weight map ({exc})") from None
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise PlanError(f"{root} has no .safetensors files (a .bin checkpoint's shapes cannot be read cheaply)")
    tensors = []
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            tensors.append(TensorInfo(name, str(entry["dtype"]), tuple(int(d) for d in entry["shape"])))
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{root}/config.json: cannot read ({exc})") from None
    config = config.get("text_config", config)

    def dim(*names: str, default: int | None = None) -> int:
        for n in names:
            if isinstance(config.get(n), int):
                return int(config[n])
        if default is None:
            raise PlanError(f"{root}/config.json has none of {', '.join(names)}")
        return default

    hidden = dim("hidden_size", "n_embd", "d_model")
    heads = dim("num_attention_heads", "n_head")
    return ModelInfo(
        directory=str(root),
        tensors=tuple(tensors),
        hidden_size=hidden,
        intermediate_size=dim("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        num_layers=dim("num_hidden_layers", "n_layer", "num_layers"),
        num_heads=heads,
        num_kv_heads=dim("num_key_value_heads", default=heads),
        vocab_size=dim("vocab_size"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )
