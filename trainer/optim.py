"""Optimizer and learning-rate schedule: AdamW or Adafactor, linear warmup then cosine decay.

With ``[train] optimizer_in_backward`` the optimizer is an :class:`OptimizerInBackward`:
one optimizer per parameter, stepped from that parameter's post-accumulate-grad hook
during backward, after which the gradient is freed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from jobgen.spec.tables.run import TrainSpec

# The cosine decays to this fraction of the peak rather than to zero.
MIN_LR_RATIO = 0.1


def _fused_adamw_applies(params: list[torch.nn.Parameter]) -> bool:
    """torch's fused AdamW (one kernel per step instead of a pass per operation: 10% of a CPU
    step of a small model was AdamW's sqrt, div, mul and lerp passes) takes floating-point
    parameters on CPU and CUDA, plain or DTensor shards (FSDP2), all on one device type."""
    kinds = {p.device.type for p in params}
    return len(kinds) == 1 and kinds <= {"cpu", "cuda"} and all(p.is_floating_point() for p in params)


def _make_optimizer(params: list[torch.nn.Parameter], spec: TrainSpec) -> torch.optim.Optimizer:
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=spec.lr,
            weight_decay=spec.weight_decay,
            betas=(0.9, 0.95),
            eps=1e-8,
            fused=_fused_adamw_applies(params) or None,
        )
    # No first moment and a factored second moment: the low-memory choice.
    return torch.optim.Adafactor(params, lr=spec.lr, weight_decay=spec.weight_decay)


def build_optimizer(
    params: list[torch.nn.Parameter], spec: TrainSpec, norm_group: dist.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """The optimizer over ``params``: a plain one, or with ``optimizer_in_backward`` an
    :class:`OptimizerInBackward` whose hooks are registered on ``params`` already, summing
    the gradient norm over ``norm_group`` (trainer.parallel.strategies's ``Strategy.norm_group``)."""
    if not params:
        raise RuntimeError("no trainable parameters")
    if spec.optimizer_in_backward:
        clip = spec.grad_clip if spec.grad_clip_mode == "per_parameter" else 0.0
        return OptimizerInBackward(
            params,
            lambda group: _make_optimizer(group, spec),
            lr=spec.lr,
            max_norm=clip,
            norm_group=norm_group,
        )
    return _make_optimizer(params, spec)


def clip_per_parameter(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip each parameter's gradient norm to ``max_norm`` on its own; returns the global norm
    of the gradients before clipping (a plain tensor, also for FSDP's DTensors)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    for p in params:
        if p.grad is not None:
            torch.nn.utils.clip_grad_norm_([p], max_norm)
    return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter, each stepped by its parameter's post-accumulate-grad hook
    as soon as the gradient is complete; the gradient is freed right after.

    The wrapper itself is an ``Optimizer`` with one param group holding every parameter, so the
    LR scheduler drives it as it drives a plain optimizer: each hook hands the group's current
    ``lr`` to its parameter's optimizer before stepping it. :meth:`step` does no work (the steps
    ran during backward). Checkpoints hold the per-parameter optimizers (:attr:`optimizers`,
    which ``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` accept as
    a list) keyed by parameter name, exactly as one optimizer's state would be; the ``lr`` comes
    from the scheduler's state on resume (:meth:`set_lr`).

    With FSDP2 the hooks fire on the sharded parameters after the reduce-scatter, with this
    rank's shard of the averaged gradient (``foreach_reduce`` calls them). ``max_norm`` > 0 clips
    each parameter's gradient norm in its hook (per-parameter clipping). The squared gradient
    norms are summed in the hooks; :meth:`grad_norm` returns their global square root, summed
    over ``norm_group`` (None: the world), the ranks whose shards together make the model once:
    under HSDP the ``shard`` dimension, as the replicas hold the same shards
    (trainer.parallel.strategies's ``norm_group``).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        *,
        lr: float,
        max_norm: float = 0.0,
        norm_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(params, {"lr": lr})
        self.max_norm = max_norm
        self.norm_group = norm_group
        self.optimizers: dict[torch.nn.Parameter, torch.optim.Optimizer] = {p: make_optimizer([p]) for p in params}
        self._sum_sq: torch.Tensor | None = None
        self._sharded = any(hasattr(p, "to_local") for p in params)
        self._handles = [p.register_post_accumulate_grad_hook(self._step_parameter) for p in params]

    def _step_parameter(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        local = _local(grad).detach()
        sq = torch.linalg.vector_norm(local, dtype=torch.float32).square()
        self._sum_sq = sq if self._sum_sq is None else self._sum_sq + sq
        if self.max_norm > 0:
            torch.nn.utils.clip_grad_norm_([param], self.max_norm)
        optimizer = self.optimizers[param]
        optimizer.param_groups[0]["lr"] = self.param_groups[0]["lr"]
        optimizer.step()
        param.grad = None

    def step(self, closure=None):
        """Nothing to do: every parameter was stepped by its hook during backward."""
        return None

    def set_lr(self, lr: float) -> None:
        """The scheduler's current lr, after its state was loaded (the per-parameter optimizers'
        saved groups hold the lr of the step before)."""
        for group in self.param_groups:
            group["lr"] = lr

    def grad_norm(self) -> float:
        """The global L2 norm, before clipping, of the gradients the hooks saw since the last
        call; NaN when none did. Collective under FSDP and HSDP over ``norm_group`` (each rank
        saw its shards)."""
        sum_sq = self._sum_sq
        self._sum_sq = None
        device = next(iter(self.optimizers)).device
        if sum_sq is None:
            sum_sq = torch.full((), float("nan"), device=device)
        if self._sharded and dist.is_initialized() and dist.get_world_size(self.norm_group) > 1:
            sum_sq = sum_sq.to(device).clone()
            dist.all_reduce(sum_sq, group=self.norm_group)
        return float(sum_sq.sqrt())

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


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
