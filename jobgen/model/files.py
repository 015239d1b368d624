"""What a model directory holds, read without torch: every tensor's name, dtype and shape from
the safetensors headers, and the dimensions from ``config.json``. A directory without
safetensors is counted from config.json alone for the Llama-like families (:data:`FAMILIES`).
Every field read is checked: a malformed file is a :class:`ModelFileError` naming the file and
the field, never a TypeError or a negative size further on.

The headers are read as bytes (8-byte little-endian length, then a JSON header of
``{name: {dtype, shape, data_offsets}}``); the tensors' data is never read.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jobgen.base.sizes import MIB
from jobgen.model.experts import MoeShape, moe_config_tensors
from jobgen.model.traits import BLOCK_INDEX, ModelTraits

SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip


class PlanError(ValueError):
    """No estimate can be made from what is here (a hub id, files that cannot be read); the
    message says why. Callers report it and go on: the run itself may still be fine."""


class ModelFileError(PlanError):
    """A model file is malformed or describes an impossible model (a negative dimension, zero
    heads); the message names the file and the field. Training would fail on it too, so callers
    report it as an error, not as a missing estimate."""


class UnsizedModel(PlanError):
    """A local model directory without safetensors whose config.json is not of an architecture
    whose parameter count follows from it; the message says why."""


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


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
    traits: ModelTraits  # what decides whether a parallelism can train it
    counted_from: str = "safetensors"  # or "config.json" when there are no safetensors
    moe: MoeShape | None = None  # a mixture of experts' shape (jobgen.model.experts); None: dense

    @property
    def param_count(self) -> int:
        return sum(t.numel for t in self.parameters)

    @property
    def parameters(self) -> list[TensorInfo]:
        """The tensors that are parameters of the model: a tied head stored twice counts once;
        an MXFP4 weight (gpt-oss's ``<name>_blocks`` and ``_scales``) as the parameter the
        trainer dequantizes it into."""
        names = {t.name for t in self.tensors}
        tied_head = self.tie_word_embeddings and any(n.endswith("embed_tokens.weight") for n in names)
        out = []
        for t in self.tensors:
            if tied_head and t.name.endswith("lm_head.weight"):
                continue
            if t.name.endswith(MXFP4_SCALES) and t.name.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS in names:
                continue
            if t.name.endswith(MXFP4_BLOCKS) and t.dtype == "U8" and len(t.shape) == 4:
                experts, rows, groups, half = t.shape  # two FP4 values a byte
                t = TensorInfo(t.name.removesuffix(MXFP4_BLOCKS), "BF16", (experts, groups * half * 2, rows))
            out.append(t)
        return out

    @property
    def largest_numel(self) -> int:
        return max((t.numel for t in self.parameters), default=0)

    def layer_numels(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self.parameters:
            match = BLOCK_INDEX.search(t.name)
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
    """The JSON header of one .safetensors file without ``__metadata__`` (the tensors' data is
    not read); raises ModelFileError when it is not a safetensors header."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ModelFileError(f"{path}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > 100 * MIB:
                raise ModelFileError(f"{path}: header length {length} is not plausible")
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise PlanError(f"{path}: cannot read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: the safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    return header


def _tensor(path: Path, name: str, entry: Any) -> TensorInfo:
    """One header entry, checked: a negative or non-integer dimension would otherwise become a
    negative or nonsensical byte count that passes every check of the plan."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ModelFileError(f"{where} is a JSON {type(entry).__name__}, not an object with dtype and shape")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not dtype:
        raise ModelFileError(f"{where}: dtype {dtype!r} is not a dtype name")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ModelFileError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise ModelFileError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    if offsets[0] > offsets[1]:
        raise ModelFileError(f"{where}: data_offsets {offsets!r} end before they begin")
    return TensorInfo(name, dtype, tuple(shape))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a dimension


def _safetensors_files(root: Path) -> list[Path]:
    """The files of model.safetensors.index.json's weight map, else every *.safetensors."""
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(root.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except OSError as exc:
        raise PlanError(f"{index}: cannot read ({exc.strerror})") from None
    except (ValueError, AttributeError) as exc:  # not JSON, or JSON that is not an object
        raise ModelFileError(f"{index}: not a JSON object with a weight_map ({exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelFileError(f"{index}: weight_map is not an object of tensor name to file name")
    files = sorted({root / f for f in weight_map.values()})
    for file in files:
        if not file.is_file():
            raise ModelFileError(f"{index}: weight_map names {file.name}, which is not in {root}")
    return files


def _read_config(root: Path) -> dict[str, Any] | None:
    """config.json as an object (None when there is none)."""
    path = root / "config.json"
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise PlanError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise ModelFileError(f"{path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}: a JSON {type(config).__name__}, not a JSON object")
    if not isinstance(config.get("text_config", {}), dict):
        raise ModelFileError(f"{path}: text_config is not a JSON object")
    return config


def _dim(path: Path, config: dict[str, Any], *names: str, default: int | None = None) -> int:
    """The first of ``names`` that config.json sets (null counts as unset); it must be a positive
    integer, since a zero or negative one is an impossible model."""
    for n in names:
        value = config.get(n)
        if value is None:
            continue
        if not _is_int(value) or value <= 0:
            raise ModelFileError(f"{path}: {n} = {json.dumps(value)} is not a positive integer")
        return value
    if default is None:
        raise PlanError(f"{path} has none of {', '.join(names)}")
    return default


def _model_info(
    root: Path, config: dict[str, Any], tensors: list[TensorInfo], counted_from: str, tied: bool = True
) -> ModelInfo:
    """The dimensions from config.json, checked; ``tied`` when it does not say."""
    path = root / "config.json"
    dims = config.get("text_config", config)
    hidden = _dim(path, dims, "hidden_size", "n_embd", "d_model")
    heads = _dim(path, dims, "num_attention_heads", "n_head")
    kv_heads = _dim(path, dims, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ModelFileError(f"{path}: num_key_value_heads = {kv_heads} does not divide {heads} attention heads")
    tied_embeddings = bool(dims.get("tie_word_embeddings", tied))
    num_layers = _dim(path, dims, "num_hidden_layers", "n_layer", "num_layers")
    info = ModelInfo(
        directory=str(root),
        tensors=tuple(tensors),
        hidden_size=hidden,
        intermediate_size=_dim(path, dims, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=_dim(path, dims, "vocab_size"),
        tie_word_embeddings=tied_embeddings,
        traits=ModelTraits.of_config(config, tied=tied_embeddings),
        counted_from=counted_from,
    )
    return replace(info, moe=MoeShape.of(config, info.parameters, num_layers))


def read_model(directory: str | Path) -> ModelInfo:
    """Shapes from the safetensors headers (one file or the shards of model.safetensors.index.json)
    and dimensions from config.json; without safetensors, the shapes that config.json implies
    (:func:`config_tensors`). Raises ModelFileError for malformed files,
    UnsizedModel when config.json alone does not give the count, PlanError otherwise."""
    root = Path(directory)
    if not root.is_dir():
        raise PlanError(f"{directory} is not a local directory (a hub id is not looked up)")
    config = _read_config(root)
    files = _safetensors_files(root)
    if not files:
        if config is None:
            raise UnsizedModel(f"{root} has neither .safetensors files nor a config.json to count parameters from")
        tensors = config_tensors(root / "config.json", config)
        return _model_info(root, config, tensors, "config.json", FAMILIES[config["model_type"]].tied)
    tensors = [_tensor(file, name, entry) for file in files for name, entry in read_safetensors_header(file).items()]
    if not tensors:
        raise ModelFileError(f"{root}: no tensors in the headers of {', '.join(f.name for f in files)}")
    if config is None:
        raise PlanError(f"{root}/config.json: not there (the dimensions come from it)")
    return _model_info(root, config, tensors, "safetensors")


@dataclass(frozen=True)
class _Family:
    """How a Llama-like decoder's tensors follow from its config.json."""

    tied: bool = False  # tie_word_embeddings when config.json does not say
    qkv_bias: bool = False  # q/k/v projections always have biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms before and after the MLP too (Gemma 2 and 3)
    experts: bool = False  # routed experts instead of the dense MLP (jobgen.model.experts)
    attention_bias: bool = False  # every attention projection has a bias (gpt-oss)
    sinks: bool = False  # a learned attention sink per head (gpt-oss)


# The decoder-only families whose every tensor follows from config.json; the defaults are those
# of their transformers configuration classes.
FAMILIES = {
    "llama": _Family(),
    "mistral": _Family(),
    "qwen2": _Family(qkv_bias=True),
    "qwen3": _Family(qk_norm=True),
    "gemma": _Family(tied=True),
    "gemma2": _Family(tied=True, sandwich_norms=True),
    "gemma3_text": _Family(tied=True, sandwich_norms=True, qk_norm=True),
    "mixtral": _Family(experts=True),
    "qwen2_moe": _Family(qkv_bias=True, experts=True),
    "qwen3_moe": _Family(qk_norm=True, experts=True),
    "gpt_oss": _Family(experts=True, attention_bias=True, sinks=True),
}
_DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def config_tensors(path: Path, config: dict[str, Any]) -> list[TensorInfo]:
    """The tensors a model of one of :data:`FAMILIES` has, from its config.json alone; raises
    UnsizedModel for any other architecture (a multimodal one's other towers are not described)."""
    kind = config.get("model_type")
    if "text_config" in config or kind not in FAMILIES:
        known = ", ".join(FAMILIES)
        what = f"model_type {kind!r}" if kind else "no model_type"
        raise UnsizedModel(
            f"{path.parent} has no .safetensors files and {path} has {what}: the parameter count follows "
            f"from config.json only for {known} (a .bin checkpoint's shapes cannot be read cheaply)"
        )
    family = FAMILIES[kind]
    hidden = _dim(path, config, "hidden_size")
    heads = _dim(path, config, "num_attention_heads")
    kv = _dim(path, config, "num_key_value_heads", default=heads)
    if config.get("head_dim") is None and hidden % heads:
        raise ModelFileError(f"{path}: hidden_size = {hidden} is not a multiple of num_attention_heads = {heads}")
    head_dim = _dim(path, config, "head_dim", default=hidden // heads)
    inter, vocab = _dim(path, config, "intermediate_size"), _dim(path, config, "vocab_size")
    attn_bias, mlp_bias = bool(config.get("attention_bias")) or family.attention_bias, bool(config.get("mlp_bias"))
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    if not config.get("tie_word_embeddings", family.tied):
        shapes["lm_head.weight"] = [vocab, hidden]
    projections = {
        "self_attn.q_proj": ([heads * head_dim, hidden], attn_bias or family.qkv_bias),
        "self_attn.k_proj": ([kv * head_dim, hidden], attn_bias or family.qkv_bias),
        "self_attn.v_proj": ([kv * head_dim, hidden], attn_bias or family.qkv_bias),
        "self_attn.o_proj": ([hidden, heads * head_dim], attn_bias),
    }
    if not family.experts:
        projections |= {
            "mlp.gate_proj": ([inter, hidden], mlp_bias),
            "mlp.up_proj": ([inter, hidden], mlp_bias),
            "mlp.down_proj": ([hidden, inter], mlp_bias),
        }
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if family.sandwich_norms else []
    for i in range(_dim(path, config, "num_hidden_layers")):
        prefix = f"model.layers.{i}."
        for name, (shape, bias) in projections.items():
            shapes[prefix + name + ".weight"] = shape
            if bias:
                shapes[prefix + name + ".bias"] = shape[:1]
        shapes |= {prefix + n + ".weight": [hidden] for n in norms}
        if family.qk_norm:
            shapes |= {prefix + "self_attn.q_norm.weight": [head_dim], prefix + "self_attn.k_norm.weight": [head_dim]}
        if family.sinks:
            shapes[prefix + "self_attn.sinks"] = [heads]
    layers = _dim(path, config, "num_hidden_layers")
    shapes |= moe_config_tensors(config, hidden, layers) if family.experts else {}
    dtype = _DTYPE_NAMES.get(str(config.get("torch_dtype") or config.get("dtype")), "F32")
    return [TensorInfo(name, dtype, tuple(shape)) for name, shape in shapes.items()]
