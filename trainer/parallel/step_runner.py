"""One optimizer step's forward, backward and clipping, as the parallelism runs it: the part of
a step that differs between strategies (trainer/parallel/strategies.py's table names one runner per
``train.parallelism``); the Trainer (trainer/loop.py) does the rest (counting tokens, the loss
normalisation, the optimizer and the scheduler, the metrics).

- :class:`DataParallelSteps` (ddp, fsdp, hsdp): each micro-batch through the whole model on
  this rank, gradients synchronised on the last one only.
- ``trainer.parallel.pipeline_steps.PipelineSteps`` (pipeline): each micro-batch through torch's
  pipeline schedule, split into ``train.pipeline.microbatches`` pieces.

Both are built from the Trainer's :class:`trainer.parallel.step_parts.StepParts` (the model, the device,
the loss path) and nothing else of it. Both take the micro-batches of one step and ``scale`` =
data-parallel replicas / target tokens of the global batch, and return this rank's summed
(unscaled) loss, so that the sum over the world divided by the global target count is the step's
token-mean loss. :func:`forward_loss_sum` is the loss path the evaluator shares with training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from trainer.data.batches import model_inputs_on, to_device
from trainer.data.packing import count_targets, token_loss_sum
from trainer.memory.activation_offload import offload_activations
from trainer.model.architecture import pretrained_model
from trainer.model.prep import trainable_parameters
from trainer.optim import clip_per_parameter
from trainer.parallel.step_parts import StepParts


class StepRunner(Protocol):
    """What the loop asks of a parallelism each step."""

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], scale: float) -> torch.Tensor:
        """Forward and backward of every micro-batch; this rank's summed loss (float64, CPU)."""
        ...

    def clip(self, max_norm: float) -> float:
        """The whole model's gradient norm, after clipping to ``max_norm`` (inf: none)."""
        ...

    def eval_loss_sum(self, inputs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
        """Forward only: this rank's summed next-token loss of one evaluation batch."""
        ...

    @property
    def scores_eval(self) -> bool:
        """Whether this rank's evaluation batches are counted (a pipeline's last stage scores
        them; every rank of a data-parallel run scores its own)."""
        ...

    @property
    def greedy_token(self) -> Callable[[torch.Tensor], int] | None:
        """The next token of one row, agreed by every rank, where the model cannot generate with
        its own forward and cache (a pipeline's stages); None where it can."""
        ...

    def step_report(self) -> dict[str, float]:
        """What the step's metrics line adds of this parallelism (collective on every rank)."""
        ...


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on GPUs (FSDP2 keeps float32 masters), nothing on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# trainer.parallel.strategies's Strategy.sync_context: (model, last micro-step) -> context manager.
SyncSwitch = Callable[[torch.nn.Module, bool], contextlib.AbstractContextManager]


class DataParallelSteps:
    """Every rank runs the whole model (or its FSDP units) on its own rows."""

    scores_eval = True
    greedy_token = None

    def __init__(self, parts: StepParts, sync_context: SyncSwitch):
        """``sync_context``: the parallelism's switch that skips the gradient sync before the
        last micro-step (DDP's no_sync, FSDP2's switches: trainer.parallel.strategies's entry)."""
        self.parts = parts
        self.sync_context = sync_context

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], scale: float) -> torch.Tensor:
        parts = self.parts
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(micro_batches):
            with self._share_of(batch) as (inputs, labels), offload_activations(parts.offloader):
                with self.sync_context(parts.model, i == len(micro_batches) - 1), autocast_for(parts.env.device):
                    summed = forward_loss_sum(parts, inputs, labels)
                (summed * scale).backward()  # with optimizer_in_backward, the parameters step here
            loss_sum += summed.detach().double().cpu()
        return loss_sum

    def eval_loss_sum(self, inputs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
        return forward_loss_sum(self.parts, inputs, labels)

    def step_report(self) -> dict[str, float]:
        """With train.expert_parallel, the routed rows' load (trainer.parallel.expert_parallel)."""
        state = getattr(self.parts.model, "expert_parallel_state", None)
        return state.load_report() if state is not None else {}

    @contextlib.contextmanager
    def _share_of(self, batch: dict[str, torch.Tensor]) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        """The model's inputs and the labels of this rank's share of ``batch``: all of it, or
        with train.context_parallel its tokens of every row, with the group's attention layout
        active through forward and backward (checkpointed attention runs again in backward)."""
        device, context = self.parts.env.device, self.parts.context
        if context is None:
            yield model_inputs_on(batch, device), batch["labels"]
            return
        local = context.shard(batch)
        with context.active(local):
            yield local.model_inputs(device), local.labels

    def clip(self, max_norm: float) -> float:
        params = trainable_parameters(self.parts.model)
        train = self.parts.train
        if train.grad_clip > 0 and train.grad_clip_mode == "per_parameter":
            return float(clip_per_parameter(params, train.grad_clip))
        if train.expert_parallel > 1:  # shards on two meshes, which torch's clipping cannot stack
            from trainer.parallel.expert_parallel import clip_grad_norm

            return float(clip_grad_norm(params, max_norm))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        return float(grad_norm)


def forward_loss_sum(parts: StepParts, inputs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
    """A micro-batch's summed next-token loss through ``parts.model``: from the logits, or with
    a loss head computed inside the forward by the output layer; plus the router's auxiliary
    loss where the model computes one (:func:`router_aux_sum`). The evaluator's loss too (a
    pipeline's is trainer.parallel.pipeline_forward's, through its stages)."""
    if parts.loss_head is None:
        output = parts.model(**inputs)
        # A context-parallel share's labels are shifted already (across its chunks' edges).
        loss_sum = token_loss_sum if parts.context is None else parts.context.loss_sum
        summed, count = loss_sum(output.logits.float(), to_device(labels, parts.env.device))
        return summed + router_aux_sum(parts.model, output, count)
    with parts.loss_head.targets(labels):
        output = parts.model(**inputs)
    summed = parts.loss_head.loss_sum(output.logits)
    return summed + router_aux_sum(parts.model, output, count_targets(labels))


def router_aux_sum(model: torch.nn.Module, output: Any, targets: torch.Tensor | int) -> torch.Tensor | float:
    """The router's load-balancing loss as the model defines it: a mixture of experts whose
    config sets ``output_router_logits`` returns ``aux_loss`` from its forward, and its causal
    LM adds ``router_aux_loss_coef x aux_loss`` to the micro-batch's mean loss. Here the loss is
    a sum over target tokens (divided by the global count later), so the same term is added
    weighted by the micro-batch's targets: a whole-batch step's loss is the model's own. 0
    where the model computes none."""
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        return 0.0
    coefficient = float(getattr(pretrained_model(model).config, "router_aux_loss_coef", 0.0) or 0.0)
    return coefficient * aux.float() * targets
