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

A mixture of sources (``[[data.sources]]``) is drawn by :class:`MixtureSampler`, cut into
steps and ranks the same way; :func:`mixture_shares` turns the sources' weights and epochs
into their shares of the rows (docs/data.md).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
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
        if "sources" in state:
            raise ResumeMismatch("the checkpoint was written for a mixture of data sources, this run reads one")
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


# A mixture draws its slots by a Kronecker sequence: slot j belongs to the source whose interval
# of [0, 2^64) holds (phase + j * GOLDEN) mod 2^64. Integer arithmetic, so every rank and every
# machine agrees; its discrepancy is O(log n), so any window of slots (a global batch, one rank's
# share of it, the whole run) holds each source in its share to within a few slots.
_SCALE = 1 << 64
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd


@dataclass(frozen=True)
class MixtureSource:
    """One source as the mixture sampler sees it: its name, rows and share of the slots."""

    name: str
    num_rows: int
    share: Fraction  # of the rows drawn


def _thresholds(sources: Sequence[MixtureSource]) -> list[int]:
    """The upper end of each source's interval of [0, 2^64), exact: the shares are fractions."""
    total = sum((s.share for s in sources), Fraction(0))
    ends, cumulative = [], Fraction(0)
    for source in sources:
        cumulative += source.share
        ends.append(int(cumulative / total * _SCALE))
    ends[-1] = _SCALE
    return ends


class MixtureSampler:
    """Infinite, deterministic, resumable distributed sampling from several sources by share.

    Global slot ``j`` (the ``j``-th row of the run's order, the same cut into optimizer steps,
    micro-steps and rank slices as :class:`ResumableSampler`) belongs to one source by the
    Kronecker sequence above; the ``k``-th slot of source ``i`` is row ``k mod n_i`` of that
    source's epoch ``k div n_i``, a permutation drawn from ``(seed, source name, epoch)``. Each
    source goes through all its rows before it repeats one, whatever the others do.

    ``next_batch()`` returns (source index, row) pairs of this rank's slice of the next
    micro-step; ``last_slots`` holds every rank's, for counting tokens per source. The state is
    the slots drawn and the draws per source; it is the same on every rank, and a run resumed on
    another world size that keeps the global batch continues the same order.
    """

    def __init__(
        self,
        sources: Sequence[MixtureSource],
        *,
        world_size: int,
        rank: int,
        micro_batch_size: int,
        seed: int,
        grad_accum: int = 1,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not within world_size {world_size}")
        if micro_batch_size < 1 or grad_accum < 1:
            raise ValueError("micro_batch_size and grad_accum must be at least 1")
        if not sources or any(s.num_rows < 1 or s.share <= 0 for s in sources):
            raise ValueError("a mixture needs sources with rows and a share above 0")
        self.sources = list(sources)
        self.rank, self.world_size = rank, world_size
        self.micro_batch_size = micro_batch_size
        self.micro_step_rows = world_size * micro_batch_size
        self.seed = int(seed)
        self.ends = _thresholds(self.sources)
        digest = hashlib.sha256(f"jobgen-mixture:{seed}".encode()).digest()
        self.phase = int.from_bytes(digest[:8], "little")
        self.offset = 0  # slots drawn
        self.drawn = [0] * len(self.sources)  # slots drawn per source
        self.last_slots: list[tuple[int, int]] = []
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def source_of(self, slot: int) -> int:
        """The source of global slot ``slot``."""
        return bisect.bisect_right(self.ends, (self.phase + slot * _GOLDEN) % _SCALE)

    def _row(self, source: int, draw: int) -> int:
        n = self.sources[source].num_rows
        key = (source, draw // n)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.sources):
                self._perms.clear()  # bounded: a source needs its current epoch's order only
            seed = int.from_bytes(
                hashlib.sha256(f"{self.seed}:{self.sources[source].name}".encode()).digest()[:4], "little"
            )
            self._perms[key] = epoch_permutation(n, seed, draw // n)
        return int(self._perms[key][draw % n])

    def next_batch(self) -> list[tuple[int, int]]:
        """This rank's (source, row) pairs of the next micro-step."""
        slots = []
        for slot in range(self.offset, self.offset + self.micro_step_rows):
            source = self.source_of(slot)
            slots.append((source, self._row(source, self.drawn[source])))
            self.drawn[source] += 1
        self.offset += self.micro_step_rows
        self.last_slots = slots
        start = self.rank * self.micro_batch_size
        return slots[start : start + self.micro_batch_size]

    def _identity(self) -> list[list[Any]]:
        return [[s.name, s.num_rows, str(s.share)] for s in self.sources]

    def state_dict(self) -> dict[str, Any]:
        """Identical on every rank: the slots drawn, per source too, and what they were drawn from."""
        return {"offset": self.offset, "drawn": list(self.drawn), "sources": self._identity(), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; other sources, rows, shares or seed are an error: the order would differ."""
        if "sources" not in state:
            raise ResumeMismatch("the checkpoint was written for one data source, this run reads a mixture")
        recorded = [[str(name), int(rows), str(share)] for name, rows, share in state["sources"]]
        if recorded != self._identity():
            raise ResumeMismatch(
                f"the checkpoint's mixture was {_describe(recorded)}, this run's is {_describe(self._identity())}: "
                "a source, its rows or its share changed, so the remaining order cannot be reproduced"
            )
        if int(state["seed"]) != self.seed:
            raise ResumeMismatch(
                f"the checkpoint's sampler seed is {state['seed']}, this run's (train.seed) is {self.seed}: "
                "the remaining sample order cannot be reproduced"
            )
        drawn = [int(n) for n in state["drawn"]]
        if len(drawn) != len(self.sources) or sum(drawn) != int(state["offset"]) or min(drawn) < 0:
            raise ValueError(f"invalid mixture sampler state: offset {state['offset']}, drawn {drawn}")
        self.offset, self.drawn = int(state["offset"]), drawn


def _describe(sources: list[list[Any]]) -> str:
    return ", ".join(f"{name} ({rows} rows, share {share})" for name, rows, share in sources)


class MixtureError(ValueError):
    """The mixture's weights and epochs cannot be honoured with the run's data and length."""


def mixture_shares(
    amounts: Sequence[tuple[str, float | None, float | None]],
    rows: Sequence[int],
    tokens: Sequence[int],
    run_rows: int,
) -> list[Fraction]:
    """Each source's share of the rows drawn, exact. ``amounts``: (name, weight, epochs) per
    source (one of the two given); ``rows``/``tokens``: the rows the sampler draws from each and
    their tokens; ``run_rows``: the rows the whole run draws (max_steps x global batch).

    A source given epochs takes ``epochs x rows / run_rows`` of the rows; the weighted sources
    share what is left so that their tokens are in proportion to their weights (a source of
    longer rows is drawn from less often). With no weighted source the shares are in proportion
    to epochs x rows."""
    fixed = {i: Fraction(e) * rows[i] for i, (_n, _w, e) in enumerate(amounts) if e is not None}
    weighted = {i: Fraction(w) * rows[i] / tokens[i] for i, (_n, w, _e) in enumerate(amounts) if w is not None}
    if not weighted:
        total = sum(fixed.values(), Fraction(0))
        return [fixed[i] / total for i in range(len(amounts))]
    taken = sum(fixed.values(), Fraction(0)) / run_rows
    if taken >= 1:
        names = ", ".join(amounts[i][0] for i in fixed)
        raise MixtureError(
            f"the epochs of {names} ask for {int(sum(fixed.values()))} rows, and the run draws {run_rows} "
            "(train.max_steps x the global batch): nothing is left for the weighted sources; "
            "lower those epochs or raise train.max_steps"
        )
    scale = (1 - taken) / sum(weighted.values(), Fraction(0))
    return [fixed[i] / run_rows if i in fixed else weighted[i] * scale for i in range(len(amounts))]
