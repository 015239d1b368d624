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
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from jobgen.base.atomic import staged_directory
from jobgen.runs.rundir import RunDir
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.model import ModelSpec
from trainer.checkpoints.checkpointer import complete_checkpoints
from trainer.checkpoints.export_weights import (
    ADAPTER,
    ExportError,
    Unreadable,
    Weights,
    adapter_weights,
    export_dtype,
    full_weights,
    merged_weights,
    open_checkpoint,
    trained_dtype,
)
from trainer.checkpoints.hf_shards import (
    MAX_SHARD_BYTES,
    READ_BATCH_BYTES,
    SafetensorsModel,
    TensorPlan,
    write_safetensors,
    write_sharded,
)
from trainer.checkpoints.hub_layout import HubLayout
from trainer.model.build import add_lora, load_tokenizer
from trainer.model.mxfp4 import is_mxfp4


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
        source = open_checkpoint(path)
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
                _save_config(config, model_spec.path, written[0], staging, model_spec.export_quantization == "base")
            load_tokenizer(model_spec.path).save_pretrained(staging)
            (staging / "jobgen_export.txt").write_text(f"run {run_dir}\ncheckpoint {source.name}\n")
    except OSError as exc:  # the target's filesystem (full, read-only), the base model's files: not the checkpoint
        raise ExportError(f"export to {target} failed: {exc}") from exc
    return source


def _weights(model_spec: ModelSpec, skeleton: torch.nn.Module, merge_lora: bool) -> Weights:
    """What is exported: every weight, the adapters alone, or the base model's with the adapters merged."""
    if model_spec.lora is None:
        keep = model_spec.export_quantization == "base"
        return full_weights(skeleton, _hub_layout(skeleton, model_spec.path, keep_quantization=keep))
    if merge_lora:
        return merged_weights(skeleton, _base_weights(model_spec.path))
    return adapter_weights(skeleton)


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


def _hub_layout(skeleton: torch.nn.Module, path: str, keep_quantization: bool = False) -> HubLayout:
    """The base model's files' layout (its MXFP4 weights quantized again with
    ``keep_quantization``); the in-memory names where they cannot be read (no safetensors: a
    .bin model, whose names transformers reads as they are)."""
    try:
        base = _base_weights(path)
    except ExportError:
        return HubLayout.as_in_memory()
    return HubLayout.of(skeleton, base.tensors, keep_quantization=keep_quantization)


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


def _save_config(config, path: str, dtype: torch.dtype, staging: Path, keep_quantization: bool = False) -> None:
    """config.json in the export dtype with the KV cache on (training turns it off), without
    the base model's MXFP4 quantization unless the export keeps it (model.export_quantization),
    and the generation config the base model has, or the one from_pretrained would derive."""
    from transformers import GenerationConfig

    config.dtype = dtype
    config.use_cache = True
    if is_mxfp4(config) and not keep_quantization:  # the weights are written dequantized, as they trained
        del config.quantization_config
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
