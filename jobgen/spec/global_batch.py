"""The global batch across world sizes: how many sequences one optimizer step sees.

``micro_batch_size x grad_accum x world size``. A run that resumes on another world size
(other nodes, fewer nodes with ``job.min_nodes``, other processes per node) keeps its
global batch only if ``grad_accum`` follows: with ``train.global_batch_size`` set,
``grad_accum`` is derived for each task from the world it gets. Without it, a resume whose
global batch differs from the checkpoint's is refused (:class:`GlobalBatchChanged`) unless
``train.allow_batch_change = true``: a silently halved batch changes the optimisation (the
learning rate was tuned for the other one) with nothing in the log but "world size 1".

The data position is the number of samples consumed (trainer/data/sampler.py): any world size
that keeps the global batch reads exactly the samples an uninterrupted run had not read.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobgen.spec.tables.train import TrainSpec

FIX = (
    "Set train.global_batch_size (grad_accum is then derived from each task's world size), "
    "or train.allow_batch_change = true to go on with the new batch"
)


class GlobalBatchError(ValueError):
    """train.global_batch_size does not divide into this world's micro-batches."""


class GlobalBatchChanged(Exception):
    """A resume would change the global batch of a run without train.global_batch_size."""

    def __init__(self, saved: BatchShape, now: BatchShape):
        self.saved, self.now = saved, now
        super().__init__(
            f"the checkpoint was trained with a global batch of {saved.global_batch} sequences "
            f"({saved.describe()}); this task's is {now.global_batch} ({now.describe()}). {FIX}"
        )


@dataclass(frozen=True)
class BatchShape:
    """How one task splits its optimizer step: what checkpoints record and status shows."""

    micro_batch_size: int
    grad_accum: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    def describe(self) -> str:
        return (
            f"train.micro_batch_size {self.micro_batch_size} x train.grad_accum {self.grad_accum} x "
            f"world size {self.world_size}"
        )

    def to_json(self) -> dict[str, int]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "grad_accum": self.grad_accum,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
        }

    @classmethod
    def from_json(cls, data: object) -> BatchShape | None:
        """The shape a checkpoint recorded; None for one written before shapes were recorded."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(int(data["micro_batch_size"]), int(data["grad_accum"]), int(data["world_size"]))
        except (KeyError, TypeError, ValueError):
            return None


def grad_accum_for(train: TrainSpec, world_size: int) -> int:
    """The micro-steps per optimizer step on ``world_size`` ranks: train.grad_accum, or derived
    from train.global_batch_size. GlobalBatchError names the keys when it does not divide."""
    if train.global_batch_size is None:
        return train.grad_accum
    replicas = train.data_parallel_size(world_size)
    per_micro_step = train.micro_batch_size * replicas
    if train.global_batch_size % per_micro_step:
        ranks = f"world size {world_size}" if replicas == world_size else f"{replicas} pipelines of the world"
        raise GlobalBatchError(
            f"train.global_batch_size {train.global_batch_size} is not a multiple of train.micro_batch_size "
            f"{train.micro_batch_size} x {ranks} = {per_micro_step} (the sequences of one "
            "micro-step): change either, or the nodes or processes per node"
        )
    return train.global_batch_size // per_micro_step


def shape_for(train: TrainSpec, world_size: int) -> BatchShape:
    """The batch of a task on ``world_size`` ranks. ``BatchShape.world_size`` counts the
    data-parallel replicas (the ranks, unless a pipeline spans several)."""
    replicas = train.data_parallel_size(world_size)
    return BatchShape(train.micro_batch_size, grad_accum_for(train, world_size), replicas)


def check_resume(saved: BatchShape | None, now: BatchShape, train: TrainSpec) -> None:
    """Refuse a resume that changes the global batch without the user saying so."""
    if saved is None or saved.global_batch == now.global_batch or train.allow_batch_change:
        return
    raise GlobalBatchChanged(saved, now)
