"""What the Trainer hands its step runner and its evaluator: :class:`StepParts`, the model as
this rank trains it and everything a micro-batch's forward, loss and backward go through.

The Trainer (trainer/loop.py) builds it once, after the model, and passes it explicitly: to
its parallelism's step runner (trainer/parallel/strategies.py's ``Strategy.runner``:
trainer/parallel/step_runner.py, trainer/parallel/pipeline_steps.py) and to its evaluation
(trainer/evaluation/in_training.py). Nothing else of the Trainer reaches them: they count no tokens and
step no optimizer (the loop does), so they need none of its counters, its optimizer, its
scheduler or its checkpointer. It lives in trainer/parallel/, with the runners that take it:
the lowest room that holds every type it carries (the context-parallel group is
trainer.parallel.context_parallel's), so that the runners import it from their own room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from jobgen.spec.tables.train import TrainSpec
    from trainer.distributed import DistEnv
    from trainer.memory.activation_offload import ActivationOffloader
    from trainer.memory.chunked_loss import ChunkedLoss
    from trainer.parallel.context_parallel import ContextParallel


@dataclass(frozen=True)
class StepParts:
    """The model as this rank trains it, and what a micro-batch goes through on its way."""

    # The model as train.parallelism built it: wrapped (DDP, FSDP2, HSDP), or this rank's
    # pipeline stages (a trainer.parallel.pipeline.StageModule).
    model: torch.nn.Module
    # This rank, its world, and the device its micro-batches go to.
    env: DistEnv
    # The [train] settings a step reads: parallelism (the runner's entry), grad_clip and
    # grad_clip_mode.
    train: TrainSpec
    # The pad token of the tokenizer: a pipeline pads the step's micro-batches to one length.
    pad_token_id: int
    # train.context_parallel's group (each rank runs its share of every row's tokens), or None.
    context: ContextParallel | None
    # The loss computed inside the output layer (model.loss_chunk_tokens, train.target_logits_only),
    # or None: the loss from the whole sequence's logits.
    loss_head: ChunkedLoss | None
    # model.activation_offloading: the tensors saved for backward kept in host memory, or None.
    offloader: ActivationOffloader | None
