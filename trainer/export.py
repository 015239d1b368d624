"""Consolidate a sharded checkpoint into a Hugging Face model directory.

The newest complete checkpoint that loads is exported (a checkpoint cut by a crash
or a bad disk is skipped, and the export says which and why), or the one named.

    jobgen export RUN --to DIR [--checkpoint step-00000120] [--merge-lora]

Runs in one process without a process group: torch.distributed.checkpoint reads
every shard, whatever world size or parallelism (DDP or FSDP2) wrote them. The
result is written next to DIR under a temporary name and renamed into place, and
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it. With LoRA, the adapters are
saved as a peft adapter directory, or merged into the base weights on request.

This module owns the consolidation; where checkpoints are and which are complete
comes from the run directory's layout (jobgen.rundir via trainer.checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from jobgen.atomic import staged_directory
from jobgen.loader import ResolvedSpec
from jobgen.rundir import RunDir
from trainer.checkpoint import complete_checkpoints, describe_load_error, state_dict_options
from trainer.model import DTYPES, load_model, load_tokenizer


class ExportError(RuntimeError):
    """The export cannot be made; the message says which checkpoint and why."""


def candidates(run_dir: Path, name: str | None) -> list[Path]:
    """The checkpoint asked for, or every complete one, newest first."""
    root = RunDir(run_dir).checkpoints
    if name:
        path = root / name
        if not path.is_dir():
            raise ExportError(f"no checkpoint {name} in {root}")
        return [path]
    found = complete_checkpoints(root)
    if not found:
        raise ExportError(f"no complete checkpoint in {root}")
    return found


def export(
    spec: ResolvedSpec,
    run_dir: Path,
    target: Path,
    *,
    checkpoint: str | None = None,
    merge_lora: bool = False,
    report: Callable[[str], None] = print,
) -> Path:
    """Export the newest checkpoint that loads (or the one named); ``report`` is told about
    every checkpoint skipped and why. Returns the checkpoint exported."""
    model_spec = spec.run.model
    if model_spec is None:
        raise ExportError(f"{run_dir} is not a training run (no [model])")
    if target.exists() and any(target.iterdir()):
        raise ExportError(f"{target} exists and is not empty")  # before the slow model load
    paths = candidates(run_dir, checkpoint)
    cpu = torch.device("cpu")
    # The checkpoint holds trainable weights only; the rest comes from the base model.
    model = load_model(model_spec.model_copy(update={"gradient_checkpointing": False}), cpu)
    options = state_dict_options(model)
    source, errors = None, []
    for path in paths:
        # A fresh state dict each time: a load that failed half-way may have filled part of it.
        state = {"model": get_model_state_dict(model, options=options)}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure: try the previous one
            errors.append(f"{path.name}: {describe_load_error(exc)}")
            if len(paths) > 1:
                report(f"skipped {errors[-1]}")
            continue
        source = path
        break
    if source is None:
        detail = "; ".join(errors)
        raise ExportError(
            f"checkpoint {paths[0].name} could not be loaded ({detail})"
            if checkpoint
            else f"none of the {len(paths)} checkpoint(s) in {run_dir / 'checkpoints'} could be loaded ({detail})"
        )
    set_model_state_dict(model, state["model"], options=options)
    if model_spec.lora is not None and merge_lora:
        model = model.merge_and_unload()
    model = model.to(DTYPES[model_spec.dtype])
    model.config.use_cache = True

    with staged_directory(target) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        load_tokenizer(model_spec.path).save_pretrained(staging)
        (staging / "jobgen_export.txt").write_text(f"run {run_dir}\ncheckpoint {source.name}\n")
    return source
