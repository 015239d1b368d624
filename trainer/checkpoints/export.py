"""Consolidate a sharded checkpoint into a Hugging Face model directory.

The newest complete checkpoint that loads is exported (a checkpoint cut by a crash
or a bad disk is skipped, and the export says which and why), or the one named.

    jobgen export RUN --to DIR [--checkpoint step-00000120] [--merge-lora]

Runs in one process without a process group: torch.distributed.checkpoint reads
every shard, whatever world size or parallelism (DDP or FSDP2) wrote them. The
weights are streamed, never held whole (trainer.checkpoints.hf_shards): a model larger than the
host's memory exports as well as the tiny one. The result is written next to DIR
under a temporary name and renamed into place, and
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it.

- Full fine-tuning: every weight is in the checkpoint; it is written in
  ``model.export_dtype`` (by default the one the base model's config.json names, else the
  dtype the checkpoint holds it in) as ``model-0000i-of-0000N.safetensors`` with
  ``model.safetensors.index.json``, under the names the base model's files use
  (trainer.checkpoints.hub_layout: GPT-NeoX's ``embed_out``, a mixture of experts' tensors
  one per expert, as ``save_pretrained`` writes).
- LoRA: only the adapters are in the checkpoint. They are written as a peft adapter
  directory (``PeftModel.from_pretrained(base, DIR)``), without loading the base model;
  or, with ``--merge-lora``, the base model's safetensors are streamed and each adapted
  weight gets ``scaling * B @ A`` added, as peft's ``merge_and_unload`` computes it.

Which tensors, under which names, comes from a model skeleton on the meta device
(no storage), built from the base config with LoRA applied as in training: the names
it gives are those the trainer checkpointed.

This module owns the consolidation; where checkpoints are and which are complete
comes from the run directory's layout (jobgen.runs.rundir via trainer.checkpoints.checkpointer).
"""

from __future__ import annotations

import copy
import math
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from jobgen.base.atomic import staged_directory
from jobgen.runs.rundir import RunDir
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.model import ModelSpec
from trainer.checkpoints.checkpointer import complete_checkpoints, describe_load_error
from trainer.checkpoints.hf_shards import (
    MAX_SHARD_BYTES,
    READ_BATCH_BYTES,
    DcpTensors,
    SafetensorsModel,
    TensorPlan,
    nbytes,
    write_safetensors,
    write_sharded,
)
from trainer.checkpoints.hub_layout import HubLayout
from trainer.model.build import DTYPES, add_lora, load_tokenizer

MODEL_KEY = "model."  # the checkpoint's state dict is {"model": ..., "optim": ...}
ADAPTER = "default"  # peft's adapter name, as the trainer creates it


class ExportError(RuntimeError):
    """The export cannot be made; the message says which checkpoint and why."""


class Unreadable(RuntimeError):
    """This checkpoint cannot be read (truncated, missing tensors): try the previous one."""


def candidates(run_dir: Path, name: str | None) -> list[Path]:
    """The checkpoint asked for, or every complete one, newest first."""
    root = RunDir(run_dir).checkpoints
    if name:
        return [checkpoint_dir(root, name)]
    found = complete_checkpoints(root)
    if not found:
        raise ExportError(f"no complete checkpoint in {root}")
    return found


def checkpoint_dir(root: Path, name: str) -> Path:
    """The checkpoint ``name`` of the run whose checkpoints are ``root``: a plain name directly
    in it, never a path or a link out of it (``../../other/checkpoints/step-N`` is another run's
    checkpoint, which would be exported and reported as this run's)."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ExportError(f"--checkpoint {name!r}: the name of a checkpoint in {root} (e.g. step-00000120), not a path")
    path = root / name
    if not path.is_dir():
        raise ExportError(f"no checkpoint {name} in {root}")
    if path.resolve().parent != root.resolve():
        raise ExportError(f"{path} leads to {path.resolve()}, outside {root}: not this run's checkpoint")
    return path


def export(
    spec: ResolvedSpec,
    run_dir: Path,
    target: Path,
    *,
    checkpoint: str | None = None,
    merge_lora: bool = False,
    report: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    batch_bytes: int = READ_BATCH_BYTES,
) -> Path:
    """Export the newest checkpoint that loads (or the one named); ``report`` is told about
    every checkpoint skipped and why, ``progress`` (bytes of weights written, bytes in all)
    after every batch. Returns the checkpoint exported. At most about ``batch_bytes`` of
    weights are held at a time; files are at most ``max_shard_bytes``."""
    model_spec = spec.run.model
    if model_spec is None:
        raise ExportError(f"{run_dir} is not a training run (no [model])")
    if target.exists() and any(target.iterdir()):
        raise ExportError(f"{target} exists and is not empty")  # before anything slow
    paths = candidates(run_dir, checkpoint)
    config, skeleton = _skeleton(model_spec)
    asked = export_dtype(model_spec.export_dtype, config)  # None: as trained
    adapter_only = model_spec.lora is not None and not merge_lora
    weights = _weights(model_spec, skeleton, merge_lora)
    written: list[torch.dtype] = []

    def write(path: Path, staging: Path) -> None:
        source = _open(path)
        dtype = asked or trained_dtype(source)
        written[:] = [dtype]
        plans, read_batch = weights(source, dtype)
        read = _reporting(read_batch, sum(plan.nbytes for plan in plans), progress)
        if adapter_only:
            write_safetensors(staging / "adapter_model.safetensors", plans, read, batch_bytes=batch_bytes)
        else:
            write_sharded(staging, plans, read, max_shard_bytes=max_shard_bytes, batch_bytes=batch_bytes)

    try:
        with staged_directory(target) as staging:
            source = _first_loadable(paths, staging, write, report, named=bool(checkpoint), root=run_dir)
            if adapter_only:
                _adapter_config(skeleton, model_spec).save_pretrained(staging)
            else:
                _save_config(config, model_spec.path, written[0], staging)
            load_tokenizer(model_spec.path).save_pretrained(staging)
            (staging / "jobgen_export.txt").write_text(f"run {run_dir}\ncheckpoint {source.name}\n")
    except OSError as exc:  # the target's filesystem (full, read-only), the base model's files: not the checkpoint
        raise ExportError(f"export to {target} failed: {exc}") from exc
    return source


def _weights(model_spec: ModelSpec, skeleton: torch.nn.Module, merge_lora: bool) -> Weights:
    """What is exported: every weight, the adapters alone, or the base model's with the adapters merged."""
    if model_spec.lora is None:
        return _full_weights(skeleton, _hub_layout(skeleton, model_spec.path))
    if merge_lora:
        return _merged_weights(skeleton, _base_weights(model_spec.path))
    return _adapter_weights(skeleton)


def _reporting(
    read_batch: Callable[[list[TensorPlan]], Mapping[str, torch.Tensor]],
    total: int,
    progress: Callable[[int, int], None] | None,
) -> Callable[[list[TensorPlan]], Mapping[str, torch.Tensor]]:
    """``read_batch`` that tells ``progress`` (bytes of weights read so far, ``total``) after every batch."""
    written = 0

    def read(batch: list[TensorPlan]) -> Mapping[str, torch.Tensor]:
        nonlocal written
        tensors = read_batch(batch)
        written += sum(plan.nbytes for plan in batch)
        if progress is not None:
            progress(written, total)
        return tensors

    return read


def _first_loadable(
    paths: list[Path],
    staging: Path,
    write: Callable[[Path, Path], None],
    report: Callable[[str], None],
    *,
    named: bool,
    root: Path,
) -> Path:
    """The first of ``paths`` that ``write`` gets into ``staging`` whole; every unreadable one
    before it is reported (when there was a choice) and what it left is removed."""
    errors = []
    for path in paths:
        try:
            write(path, staging)
        except Unreadable as exc:
            _empty(staging)  # what was written from it goes; the previous checkpoint starts afresh
            errors.append(f"{path.name}: {exc}")
            if len(paths) > 1:
                report(f"skipped {errors[-1]}")
            continue
        return path
    detail = "; ".join(errors)
    raise ExportError(
        f"checkpoint {paths[0].name} could not be loaded ({detail})"
        if named
        else f"none of the {len(paths)} checkpoint(s) in {root / 'checkpoints'} could be loaded ({detail})"
    )


# ---------------------------------------------------------------- what is read, what is written

# Given a checkpoint and the export dtype: the output tensors and how to read a batch of them.
Weights = Callable[
    [DcpTensors, torch.dtype], tuple[list[TensorPlan], Callable[[list[TensorPlan]], Mapping[str, torch.Tensor]]]
]


def _open(path: Path) -> DcpTensors:
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


def _full_weights(skeleton: torch.nn.Module, layout: HubLayout) -> Weights:
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
                dtype,
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
                tensor = layout.part(got[MODEL_KEY + name], output, name).to(dtype)
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


def _adapter_weights(skeleton: torch.nn.Module) -> Weights:
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


def _merged_weights(skeleton: torch.nn.Module, base: SafetensorsModel) -> Weights:
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


# ---------------------------------------------------------------- the model, without its weights


def _skeleton(model_spec: ModelSpec) -> tuple[object, torch.nn.Module]:
    """The base config, and the model built from it on the meta device (no storage), with
    LoRA adapters as the trainer adds them: the names and shapes the checkpoint uses."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        # The run's model directory may be a teammate's: no code of its own runs.
        config = AutoConfig.from_pretrained(model_spec.path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ExportError(f"model.path {model_spec.path}: {exc}") from exc
    with torch.device("meta"), warnings.catch_warnings():
        # peft asks transformers a deprecated question on every LoRA model: not the user's to act on,
        # and an export's output is its own lines.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        skeleton = AutoModelForCausalLM.from_config(config)
        if model_spec.lora is not None:
            skeleton = add_lora(skeleton, model_spec.model_copy(update={"gradient_checkpointing": False}))
    return config, skeleton


def _hub_layout(skeleton: torch.nn.Module, path: str) -> HubLayout:
    """The base model's files' layout; the in-memory names where they cannot be read (no
    safetensors: a .bin model, whose names transformers reads as they are)."""
    try:
        base = _base_weights(path)
    except ExportError:
        return HubLayout.as_in_memory()
    return HubLayout.of(skeleton, base.tensors)


def _base_weights(path: str) -> SafetensorsModel:
    directory = Path(path)
    try:
        if not directory.is_dir():  # a hub id: its snapshot in the local cache
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(path, local_files_only=True))
        return SafetensorsModel(directory)
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"--merge-lora streams the base model's safetensors: {exc}; convert it with "
            "AutoModelForCausalLM.from_pretrained(path).save_pretrained(path) first"
        ) from exc


def _adapter_config(skeleton: torch.nn.Module, model_spec: ModelSpec):
    """The LoraConfig of training, as PeftModel.save_pretrained writes it."""
    config = copy.deepcopy(skeleton.peft_config[ADAPTER])
    config.base_model_name_or_path = model_spec.path
    config.inference_mode = True
    return config


def _save_config(config, path: str, dtype: torch.dtype, staging: Path) -> None:
    """config.json in the export dtype with the KV cache on (training turns it off), and the
    generation config the base model has, or the one from_pretrained would derive."""
    from transformers import GenerationConfig

    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(staging)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(staging)


def _empty(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
