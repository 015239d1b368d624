"""Optimizer and learning-rate schedule: AdamW or Adafactor, linear warmup then cosine decay."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from jobgen.spec import TrainSpec

# The cosine decays to this fraction of the peak rather than to zero.
MIN_LR_RATIO = 0.1


def build_optimizer(params: list[torch.nn.Parameter], spec: TrainSpec) -> torch.optim.Optimizer:
    if not params:
        raise RuntimeError("no trainable parameters")
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95), eps=1e-8)
    return torch.optim.Adafactor(params, lr=spec.lr, weight_decay=spec.weight_decay)


class WarmupCosine:
    """lr multiplier at ``step``; a callable class so LambdaLR's state_dict stays plain data."""

    def __init__(self, warmup_steps: int, max_steps: int):
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, spec: TrainSpec) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(spec.warmup_steps, spec.max_steps))
