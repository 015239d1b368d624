"""Build a model that is larger than one device: on the meta device, sharded, then filled
from the Hugging Face safetensors, each rank reading only the slices it owns.

    model = build_sharded(spec.run.model, env, shard=lambda m: fully_shard_blocks(m, env))

The order is what keeps memory proportional to the shard:

1. ``from_config`` under ``torch.device("meta")``: the module tree, no storage.
2. Everything that changes the tree (LoRA adapters, checkpointing) happens on that
   skeleton. LoRA adapters are materialised and initialised by peft on the host here:
   they are small, and initialising the full tensor before sharding gives every
   world size the same adapters for the same seed.
3. ``shard`` (FSDP2's ``fully_shard``, on a 1-D mesh or HSDP's 2-D one) turns each
   parameter into a DTensor shard, still on meta; then only the modules that still hold
   meta tensors get storage on the device (``to_empty(recurse=False)``), which is each
   rank's shard (in host memory with CPU offload; buffers always on the device). Under
   HSDP the ranks of each replica read the same slices.
4. ``torch.distributed.checkpoint`` reads the safetensors through
   ``HuggingFaceStorageReader``: every rank asks for the slices of its shards, so a rank
   never holds more than its shards plus one tensor being read, and files are read by
   several threads.
   A mixture of experts' fused parameters (Mixtral's ``experts.gate_up_proj``), which the
   files store one tensor per expert, are built by trainer.model.merged_experts from the
   tensors of this rank's experts only.
5. Buffers that are not in checkpoints (rotary ``inv_freq``) are recomputed by building
   their module again on the device: what ``from_pretrained`` would have computed.

A parameter that the files lack (other than the second name of a tied weight and the
adapters) is an error naming it; a model directory without safetensors is refused with
how to convert it, rather than falling back to loading the whole model on every rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader

from jobgen.spec.tables.model import ModelSpec
from trainer.distributed import DistEnv
from trainer.model.architecture import CheckpointLayout
from trainer.model.errors import ModelError
from trainer.model.merged_experts import expert_plans, fill_merged
from trainer.model.mxfp4 import fill_mxfp4, mxfp4_plans

log = logging.getLogger("trainer.model.sharded_load")

# Names a parameter has in a peft-wrapped model that its base model's files do not.
PEFT_PREFIX = "base_model.model."
PEFT_BASE_LAYER = ".base_layer."
ADAPTER_MARKERS = ("lora_",)


class ShardedLoadError(ModelError):
    """The model directory cannot be loaded shard by shard; the message says what to change.
    A ModelError: every later task would fail the same way, so the run stops."""


def model_directory(path: str) -> Path:
    """The local directory of ``model.path``: itself, or the hub cache's snapshot (offline)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any lookup failure means the same thing here
        raise ShardedLoadError(
            f"model.path: {path} is neither a directory nor in the local hub cache ({exc})"
        ) from None


def checkpoint_name(name: str) -> str:
    """The name ``name`` (a parameter of the possibly peft-wrapped model) has in the base model's files."""
    return name.removeprefix(PEFT_PREFIX).replace(PEFT_BASE_LAYER, ".")


def is_adapter(name: str) -> bool:
    return any(marker in name for marker in ADAPTER_MARKERS)


def build_skeleton(spec: ModelSpec, dtype: torch.dtype, prepare: Callable[[torch.nn.Module], torch.nn.Module]):
    """The model on the meta device, with ``prepare`` (checkpointing, LoRA) applied to it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=False)  # no code from the model directory
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return prepare(model)


def materialise_adapters(model: torch.nn.Module) -> None:
    """Give LoRA adapters host storage and peft's initialisation, before sharding (seeded by the caller)."""
    for module in model.modules():
        reset = getattr(module, "reset_lora_parameters", None)
        if reset is None:
            continue
        for adapter in getattr(module, "active_adapters", []):
            for container in (module.lora_A, module.lora_B):
                if adapter in container:
                    container[adapter].to_empty(device="cpu")
            module.reset_lora_parameters(adapter, True)


def _on_meta(module: torch.nn.Module) -> bool:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.device.type == "meta" for t in tensors)


def allocate_shards(model: torch.nn.Module, device: torch.device, param_device: torch.device | None = None) -> None:
    """Storage for every tensor still on meta (after sharding: this rank's shards): parameters
    on ``param_device`` (the host with FSDP's CPU offload, which keeps the shards there and
    copies each unit to the GPU for its compute), buffers on ``device``, where the forward
    uses them (FSDP does not manage buffers)."""
    param_device = param_device or device
    for module in model.modules():
        if not _on_meta(module):
            continue
        module.to_empty(device=param_device, recurse=False)
        if param_device != device:
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Second (and later) names of a parameter registered under several names -> its first name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def read_weights(
    model: torch.nn.Module,
    directory: Path,
    threads: int,
    layout: CheckpointLayout | None = None,
    *,
    aliases: dict[str, str] | None = None,
) -> int:
    """Fill every non-adapter parameter and persistent buffer from the safetensors in
    ``directory``, each rank its own slices. Returns how many tensors were read. ``layout``: the
    model's checkpoint layout, read before sharding (FSDP renames the classes the library's
    conversion mapping is keyed by). ``aliases``: a parameter read from another's tensor (a
    pipeline's tied head, on a rank without the embedding)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ShardedLoadError(
            f"model.path: {directory} has no .safetensors files; FSDP loads each rank's shard from "
            "safetensors (convert once: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
            "safe_serialization=True))"
        )
    # safetensors headers (JSON) and raw tensors only: nothing in a model directory is unpickled here.
    reader = HuggingFaceStorageReader(str(directory), thread_count=max(1, min(threads, len(files))))
    available = set(reader.read_metadata().state_dict_metadata)
    # GPT-NeoX's embed_out is lm_head in memory; Mixtral's per-expert weights are one fused tensor
    # (trainer.model.merged_experts).
    renamed, merged = (layout or CheckpointLayout(model)).resolve(available)
    renamed = {**renamed, **{name: key for name, key in (aliases or {}).items() if name not in available}}
    tied = tied_names(model)
    state: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}  # the key's tensor of the model, for those the files lack
    missing: list[str] = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = checkpoint_name(name)
        key = renamed.get(key, key)
        if is_adapter(name) or name in tied:
            continue
        if key not in available:
            missing.append(key)
            tensors[key] = tensor
            continue
        state[key] = tensor.detach() if hasattr(tensor, "detach") else tensor
    # Fused experts built from the checkpoint's per-expert tensors: each rank reads its experts'.
    fused = {key: tensors[key] for key in missing if key in merged}
    plans = expert_plans({key: merged[key] for key in fused})
    # gpt-oss's MXFP4 experts, dequantized as they are read (trainer.model.mxfp4).
    quantized = mxfp4_plans([key for key in missing if key not in fused], available)
    missing = [key for key in missing if key not in fused and key not in quantized]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ShardedLoadError(f"model.path: {directory}: the safetensors lack {shown}")
    with torch.no_grad():
        dcp.load(state, storage_reader=reader)
    read = fill_mxfp4({key: tensors[key] for key in quantized}, quantized, directory)
    return len(state) + fill_merged(fused, plans, directory) + read


def recompute_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers as ``from_pretrained`` computes them. A module without parameters
    (a rotary table) is built again on ``device`` from its config; one with parameters (Gemma's
    scaled embedding and its ``embed_scale``) gets them from the model's own initialisation
    (``_init_weights``), run on a stand-in whose parameters are on the meta device, so nothing
    loaded is touched."""
    persistent = set(model.state_dict())
    for prefix, module in model.named_modules():
        own = {name for name, _ in module.named_buffers(recurse=False)}
        transient = {n for n in own if f"{prefix}.{n}".lstrip(".") not in persistent}
        if not transient:
            continue
        if any(True for _ in module.parameters(recurse=False)):
            _initialise_buffers(model, prefix, module, transient, device)
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ShardedLoadError(
                f"cannot recompute the buffers {sorted(transient)} of {prefix or 'the model'} "
                f"({type(module).__name__}) after sharded loading"
            )
        with torch.device(device):
            fresh = type(module)(config)
        for name in transient:
            setattr(module, name, getattr(fresh, name))
        for name, value in vars(fresh).items():  # e.g. attention_scaling, computed alongside
            if not name.startswith("_") and isinstance(value, (int, float)):
                setattr(module, name, value)


def _initialise_buffers(
    model: torch.nn.Module, prefix: str, module: torch.nn.Module, transient: set[str], device: torch.device
) -> None:
    """``transient`` buffers of ``module`` (which holds parameters) as the model's
    ``_init_weights`` sets them, on a stand-in of ``module``: its attributes (``scalar_embed_scale``),
    its parameters' shapes on the meta device (their initialisation costs nothing and goes
    nowhere), fresh buffers on ``device``."""
    from trainer.model.architecture import pretrained_model

    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in.__dict__["_parameters"] = {
        name: None if p is None else torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
        for name, p in module._parameters.items()
    }
    stand_in.__dict__["_buffers"] = {
        name: torch.empty(b.shape, dtype=b.dtype, device=device) if name in transient and b is not None else b
        for name, b in module._buffers.items()
    }
    stand_in.__dict__["_modules"] = {}
    # A pipeline's StageModule is no transformers model; it keeps the full model's initialiser.
    owner = model if hasattr(model, "initialise_weights") else pretrained_model(model)
    initialise = getattr(owner, "initialise_weights", None) or getattr(owner, "_init_weights", None)
    if initialise is None:
        raise ShardedLoadError(
            f"cannot recompute the buffers {sorted(transient)} of {prefix}: the model has no _init_weights"
        )
    with torch.no_grad():
        initialise(stand_in)
    for name in transient:
        module._buffers[name] = stand_in._buffers[name]


def build_sharded(
    spec: ModelSpec,
    env: DistEnv,
    dtype: torch.dtype,
    *,
    prepare: Callable[[torch.nn.Module], torch.nn.Module],
    shard: Callable[[torch.nn.Module], torch.nn.Module],
    param_device: torch.device | None = None,
) -> torch.nn.Module:
    """The model, sharded by ``shard`` and filled from its safetensors; see the module docstring.
    ``param_device``: where the parameter shards live (default ``env.device``; the host with
    CPU offload), read there directly from the files."""
    directory = model_directory(spec.path)
    model = build_skeleton(spec, dtype, prepare)
    layout = CheckpointLayout(model)  # before FSDP renames the classes
    materialise_adapters(model)
    model = shard(model)
    allocate_shards(model, env.device, param_device)
    threads = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1)))
    count = read_weights(model, directory, threads, layout)
    recompute_buffers(model, env.device)
    if env.is_main:
        log.info("loaded %d tensors of %s, each rank its own shards", count, directory)
    return model
