"""Which rows each rank trains on, in an order that survives being stopped and resumed.

Each epoch is a permutation of the ``num_rows`` rows drawn from ``(seed, epoch)``.
The permutation is cut into optimizer steps of ``micro_batch_size x grad_accum x
world_size`` consecutive rows (the global batch), each into ``grad_accum``
micro-steps of ``world_size x micro_batch_size`` rows; rank ``r`` takes the ``r``-th
slice of ``micro_batch_size`` rows of each micro-step. The ragged tail of an epoch
(fewer rows than a global batch) is dropped, and the next epoch begins. The sampler
never ends: the trainer stops on ``max_steps``.

The state is ``(epoch, offset)``: the epoch and the position in its permutation,
in rows, of the next step: the number of samples of the epoch consumed. Every rank
holds the same state, so any rank's copy can go into a checkpoint; a run resumed
from it serves exactly the rows not yet served, in the same order. Because the
offset counts rows, not batches, and the tail is cut by the global batch, a run
resumed on another world size that keeps the global batch (train.global_batch_size)
serves exactly the rows an uninterrupted run would have, epoch ends included.

The permutation comes from NumPy's legacy ``RandomState``, whose stream NumPy
promises never to change, so a resume after a library upgrade still matches.
Independent of ``torch.utils.data.DistributedSampler`` (which pads by repeating
rows and only resumes at epoch boundaries).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of one epoch: a function of (num_rows, seed, epoch) only."""
    digest = hashlib.sha256(f"jobgen-sampler:{seed}:{epoch}".encode()).digest()
    state = np.random.RandomState(int.from_bytes(digest[:4], "little"))
    return state.permutation(num_rows)


class ResumeMismatch(ValueError):
    """The checkpoint was written for other data or another seed: its order cannot continue."""


class ResumableSampler:
    """Infinite, deterministic, resumable distributed sampling of row indices.

    ``next_batch()`` returns this rank's ``micro_batch_size`` row
    indices of the next global batch and advances the state past that batch, so
    ``state_dict()`` taken after the batch of step *k* has been consumed resumes
    at step *k + 1*. Do not prefetch batches beyond the step being checkpointed.
    """

    def __init__(
        self, num_rows: int, *, world_size: int, rank: int, micro_batch_size: int, seed: int, grad_accum: int = 1
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not within world_size {world_size}")
        if micro_batch_size < 1 or grad_accum < 1:
            raise ValueError("micro_batch_size and grad_accum must be at least 1")
        self.num_rows = int(num_rows)
        self.world_size = world_size
        self.rank = rank
        self.micro_batch_size = micro_batch_size
        self.seed = int(seed)
        self.micro_step_rows = world_size * micro_batch_size
        self.global_batch = self.micro_step_rows * grad_accum  # rows of one optimizer step
        if self.num_rows < self.global_batch:
            raise ValueError(
                f"{self.num_rows} rows cannot fill one global batch of {self.global_batch} rows "
                f"({world_size} ranks x micro_batch_size {micro_batch_size} x grad_accum {grad_accum}): "
                "use more data or smaller batches"
            )
        self.epoch = 0
        self.offset = 0
        self._step_start = 0  # the offset where the current optimizer step began
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = epoch_permutation(self.num_rows, self.seed, self.epoch)
            self._perm_epoch = self.epoch
        return self._perm

    def _at_step_start(self) -> bool:
        return self.offset - self._step_start in (0, self.global_batch)

    def _normalise(self) -> None:
        # At a step's start the state points at a step that exists: past the last full one,
        # the next epoch starts. Within a step, its micro-steps fit by construction.
        if not self._at_step_start():
            return
        self._step_start = self.offset
        if self.offset + self.global_batch > self.num_rows:
            self.epoch += 1
            self.offset = self._step_start = 0

    def next_batch(self) -> list[int]:
        """This rank's rows of the next micro-step."""
        self._normalise()
        start = self.offset + self.rank * self.micro_batch_size
        rows = self._permutation()[start : start + self.micro_batch_size]
        self.offset += self.micro_step_rows
        self._normalise()
        return [int(r) for r in rows]

    def state_dict(self) -> dict[str, Any]:
        """Identical on every rank. ``epoch`` and ``offset`` locate the next batch; the rest are checks."""
        return {"epoch": self.epoch, "offset": self.offset, "num_rows": self.num_rows, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. A different dataset (row count) or seed is an error: the order would differ."""
        num_rows, seed = int(state["num_rows"]), int(state["seed"])
        if num_rows != self.num_rows:
            raise ResumeMismatch(
                f"the checkpoint's sampler had {num_rows} rows, this run has {self.num_rows}: "
                "the data, its preprocessing or packing changed, so the remaining order cannot be reproduced"
            )
        if seed != self.seed:
            raise ResumeMismatch(
                f"the checkpoint's sampler seed is {seed}, this run's (train.seed) is {self.seed}: "
                "the remaining sample order cannot be reproduced"
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= self.num_rows:
            raise ValueError(f"invalid sampler state: epoch {epoch}, offset {offset}")
        self.epoch, self.offset = epoch, offset
        self._step_start = offset  # a checkpoint is taken between steps
        self._normalise()
