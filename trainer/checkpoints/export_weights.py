"""What an export reads and writes: for each kind of export (every weight of a full fine-tune,
the adapters alone, the base model's weights with the adapters merged), the tensors written,
their names and dtypes, and how a batch of them is read from the checkpoint (or the base
model's files) and converted. trainer.checkpoints.export runs it: it picks the checkpoint,
stages the directory and writes the files.

    plans, read_batch = full_weights(skeleton, layout)(DcpTensors(checkpoint), torch.float32)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from trainer.checkpoints.checkpointer import describe_load_error
from trainer.checkpoints.hf_shards import DcpTensors, SafetensorsModel, TensorPlan, nbytes
from trainer.checkpoints.hub_layout import HubLayout
from trainer.model.build import DTYPES

MODEL_KEY = "model."  # the checkpoint's state dict is {"model": ..., "optim": ...}
ADAPTER = "default"  # peft's adapter name, as the trainer creates it


class ExportError(RuntimeError):
    """The export cannot be made; the message says which checkpoint and why."""


class Unreadable(RuntimeError):
    """This checkpoint cannot be read (truncated, missing tensors): try the previous one."""


# Given a checkpoint and the export dtype: the output tensors and how to read a batch of them.
Weights = Callable[
    [DcpTensors, torch.dtype], tuple[list[TensorPlan], Callable[[list[TensorPlan]], Mapping[str, torch.Tensor]]]
]


def open_checkpoint(path: Path) -> DcpTensors:
    try:
        return DcpTensors(path)
    except (Exception, CheckpointException) as exc:  # any failure: try the previous one
        raise Unreadable(describe_load_error(exc)) from exc


def export_dtype(choice: str, config) -> torch.dtype | None:
    """``model.export_dtype`` as a dtype; None for the checkpoint's own (:func:`trained_dtype`).
    'base' is the dtype the base model's config.json names, if it names one jobgen writes."""
    if choice == "base":
        named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)  # torch.bfloat16 or a name
        return DTYPES.get(str(named).removeprefix("torch.")) if named is not None else None
    return DTYPES.get(choice)


def trained_dtype(source: DcpTensors) -> torch.dtype:
    """The dtype the checkpoint holds most of the model's weights in: what training kept them in
    (float32 on CPU; model.dtype on a GPU), which an export 'as-trained' writes."""
    counts: dict[torch.dtype, int] = {}
    for key, (shape, dtype) in source.tensors.items():
        if key.startswith(MODEL_KEY):
            counts[dtype] = counts.get(dtype, 0) + math.prod(shape)
    if not counts:
        raise Unreadable("it holds no model weights")
    return max(counts, key=counts.__getitem__)


def _read(source: DcpTensors, keys: list[str]) -> dict[str, torch.Tensor]:
    try:
        return source.read(keys)
    except (Exception, CheckpointException) as exc:  # any failure: try the previous one
        raise Unreadable(describe_load_error(exc)) from exc


def _require(source: DcpTensors, wanted: Mapping[str, tuple[int, ...]]) -> None:
    """Every checkpoint key in ``wanted`` is there with that shape, or the checkpoint is not
    this run's model (a strict load would have refused it too)."""
    missing = [key for key in wanted if key not in source.tensors]
    if missing:
        raise Unreadable(f"{len(missing)} tensor(s) missing, e.g. {missing[0]}")
    for key, shape in wanted.items():
        if source.tensors[key][0] != shape:
            raise Unreadable(f"{key} has shape {source.tensors[key][0]}, the model needs {shape}")


def full_weights(skeleton: torch.nn.Module, layout: HubLayout) -> Weights:
    """Every weight of the model, under the names the base model's files give them (``layout``:
    renames reverted, fused experts split into their tensors, as save_pretrained writes them)."""
    names = _saved_names(skeleton)
    shapes = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    outputs = {name: layout.outputs(name, shapes[name]) for name in names}
    source_of = {output.name: (name, output) for name in names for output in outputs[name]}

    def weights(source: DcpTensors, dtype: torch.dtype):
        _require(source, {MODEL_KEY + name: shapes[name] for name in names})
        plans = [
            TensorPlan(
                output.name,
                output.shape,
                torch.uint8 if output.quantized else dtype,
                # a fused tensor is read whole, once per batch, for its experts' tensors
                read_bytes=nbytes(shapes[name], source.tensors[MODEL_KEY + name][1]) // len(outputs[name]),
            )
            for name in names
            for output in outputs[name]
        ]

        def read(batch: list[TensorPlan]) -> dict[str, torch.Tensor]:
            wanted = list(dict.fromkeys(source_of[plan.name][0] for plan in batch))
            got = _read(source, [MODEL_KEY + name for name in wanted])
            out = {}
            for plan in batch:
                name, output = source_of[plan.name]
                tensor = layout.part(got[MODEL_KEY + name], output, name)
                tensor = tensor if output.quantized else tensor.to(dtype)
                # an expert's tensor is a view into the fused one: a file gets its own storage
                out[plan.name] = tensor if output.expert is None else tensor.clone()
            return out

        return plans, read

    return weights


def _saved_names(model: torch.nn.Module) -> list[str]:
    """The state dict's names less the second name of each tied weight (lm_head.weight when
    the embeddings are tied): save_pretrained writes a tied weight once, and from_pretrained
    ties it again from config.tie_word_embeddings."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    if not tied:  # by identity, for models that do not declare them
        seen: set[int] = set()
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                tied.add(name)
            seen.add(id(param))
    return [name for name in model.state_dict() if name not in tied]


def _adapter_names(skeleton: torch.nn.Module) -> dict[str, str]:
    """Checkpoint key of each adapter weight -> its name in adapter_model.safetensors, as
    peft's own get_peft_model_state_dict renames them (the adapter name dropped)."""
    from peft.utils import get_peft_model_state_dict

    trainable = {name: param for name, param in skeleton.named_parameters() if param.requires_grad}
    by_identity = {id(param): name for name, param in trainable.items()}
    saved = get_peft_model_state_dict(skeleton, state_dict=trainable, adapter_name=ADAPTER)
    names = {MODEL_KEY + by_identity[id(param)]: name for name, param in saved.items()}
    if len(names) != len(trainable):
        left = sorted(set(trainable) - {key.removeprefix(MODEL_KEY) for key in names})
        raise ExportError(f"peft does not save these trained parameters as adapters: {', '.join(left[:5])}")
    return names


def adapter_weights(skeleton: torch.nn.Module) -> Weights:
    """The trained adapters, named as PeftModel.save_pretrained names them."""
    names = _adapter_names(skeleton)
    shapes = {MODEL_KEY + name: tuple(param.shape) for name, param in skeleton.named_parameters()}

    def weights(source: DcpTensors, dtype: torch.dtype):
        _require(source, {key: shapes[key] for key in names})
        plans = [
            TensorPlan(saved, shapes[key], dtype, read_bytes=nbytes(shapes[key], source.tensors[key][1]))
            for key, saved in names.items()
        ]
        keys = {saved: key for key, saved in names.items()}

        def read(batch: list[TensorPlan]) -> dict[str, torch.Tensor]:
            got = _read(source, [keys[plan.name] for plan in batch])
            return {plan.name: got.pop(keys[plan.name]).to(dtype) for plan in batch}

        return plans, read

    return weights


def _merge_targets(skeleton: torch.nn.Module) -> dict[str, tuple[str, str, float, bool]]:
    """Base weight name -> (lora_A key, lora_B key, scaling, fan_in_fan_out) for each adapted
    Linear; anything peft could merge only another way is refused by name."""
    from peft.tuners.lora import Linear, LoraLayer

    prefix = "base_model.model."
    targets = {}
    for name, module in skeleton.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if (
            not isinstance(module, Linear)
            or module.use_dora.get(ADAPTER)
            or getattr(module, "lora_bias", {}).get(ADAPTER)
        ):
            raise ExportError(
                f"{name}: only plain LoRA on Linear layers can be merged here; export without --merge-lora"
            )
        key = f"{MODEL_KEY}{name}.lora_%s.{ADAPTER}.weight"
        targets[name.removeprefix(prefix) + ".weight"] = (
            key % "A",
            key % "B",
            module.scaling[ADAPTER],
            module.fan_in_fan_out,
        )
    covered = {key for a, b, _, _ in targets.values() for key in (a, b)}
    other = [
        name for name, param in skeleton.named_parameters() if param.requires_grad and MODEL_KEY + name not in covered
    ]
    if other:
        raise ExportError(f"trained parameters that are not LoRA A/B cannot be merged: {', '.join(other[:5])}")
    return targets


def merged_weights(skeleton: torch.nn.Module, base: SafetensorsModel) -> Weights:
    """The base model's tensors as its files hold them, each adapted weight W replaced by
    ``W + scaling * B @ A`` in float32 (what merge_and_unload computes on the model loaded
    in float32), then cast to the export dtype."""
    targets = _merge_targets(skeleton)
    shapes = {MODEL_KEY + name: tuple(param.shape) for name, param in skeleton.named_parameters()}
    for name in targets:
        if name not in base.tensors:
            raise ExportError(f"{base.directory}: no tensor {name} to merge the adapters into")

    def weights(source: DcpTensors, dtype: torch.dtype):
        keys = [key for a, b, _, _ in targets.values() for key in (a, b)]
        _require(source, {key: shapes[key] for key in keys})
        adapters = {key: value.float() for key, value in _read(source, keys).items()}  # small: r x width each
        plans = [
            TensorPlan(name, shape, dtype, read_bytes=nbytes(shape, src) + nbytes(shape, torch.float32))
            for name, (shape, src) in base.tensors.items()
        ]

        def read(batch: list[TensorPlan]) -> dict[str, torch.Tensor]:
            got = base.read([plan.name for plan in batch])
            out = {}
            for plan in batch:
                tensor = got.pop(plan.name)
                if plan.name in targets:
                    a, b, scaling, fan_in_fan_out = targets[plan.name]
                    delta = adapters[b] @ adapters[a]
                    delta = (delta.T if fan_in_fan_out else delta) * scaling
                    tensor = tensor.float() + delta
                out[plan.name] = tensor.to(dtype)
            return out

        return plans, read

    return weights
