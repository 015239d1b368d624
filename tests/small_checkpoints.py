"""What the checkpoint and snapshot tests share: a small model and optimizer after one step, a
checkpoint of them as the trainer writes one (DCP's own writer, ``{"model", "optim"}`` from
``get_state_dict``), loading one back into zeros of the same shapes, and a trainer state of the
types trainer.loop writes."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any


def trained_tiny() -> tuple[Any, Any]:
    """A two-layer model and its AdamW after one step, the same every time."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.25, betas=(0.8, 0.9))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def save_checkpoint(directory: Path) -> tuple[Path, dict]:
    """``directory/step-00000001`` as the trainer writes a checkpoint, and the state saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = trained_tiny()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    path = directory / "step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path, state


def copy_checkpoint(saved: tuple[Path, dict], directory: Path) -> Path:
    return Path(shutil.copytree(saved[0], directory / saved[0].name))


def empty_like(state: Any) -> Any:
    import torch

    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like(v) for v in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def load_into_zeros(path: Path, like: dict) -> dict:
    """The checkpoint at ``path`` read by jobgen's reader into zeros shaped as ``like``."""
    from trainer.checkpoints.reader import load

    target = empty_like(like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        load(target, path, no_dist=True)
    return target


def trainer_state(step: int) -> dict[str, Any]:
    """A trainer state of ``step`` with every key and type trainer.loop's state_dict writes."""
    return {
        "step": step,
        "tokens_seen": 64,
        "target_tokens_seen": 32,
        "sampler": {"epoch": 0, "offset": 8, "num_rows": 10, "seed": 0},
        "scheduler": {"base_lrs": [0.25], "last_epoch": step, "_step_count": step + 1, "lr_lambdas": [None]},
        "seed": 0,
        "world_size": 1,
        "batch": {"micro_batch_size": 2},
        "saved_at": 1.0,
        "evals": {"evals": [[2, 2.5]]},
    }
