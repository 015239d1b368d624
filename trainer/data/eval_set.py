"""The evaluation set: held out from the training examples (``[eval] split``) or read from its
own path (``[eval] path``), packed or padded like training, and cut into the same
micro-batches whatever the world size.

Held-out split
    :func:`held_out` picks ``ceil(share x examples)`` example indices (at least one, and at
    least one left to train on) from a permutation drawn from ``(seed, number of examples)``
    by NumPy's legacy ``RandomState``, whose stream never changes. It depends on nothing a
    world size, a resume or a requeue changes, so the same examples are held out every time
    and are never trained on. Its digest goes into every checkpoint; a resume that would
    hold out other examples (other data, share or seed) stops with ResumeMismatch.

Batches
    The rows (sorted by length, so a batch pads little) are cut into micro-batches of
    ``micro_batch_size`` consecutive rows; batch ``k`` goes to rank ``k mod world size``.
    So the batches, and the loss summed over them, are the same on 1 or 16 ranks; a rank
    with no batch left in the last round runs a row whose every label is masked (FSDP needs
    every rank in every forward), which adds nothing to the sums.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from jobgen.spec.resolved import ResolvedSpec
from trainer.data.formats import DataError
from trainer.data.packing import IGNORE_INDEX, build_rows, collate, fetch_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.data.collective import Nodes
    from trainer.data.examples import Examples


def held_out(num_examples: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, held-out indices), each ascending: a function of its arguments only."""
    if num_examples < 2:
        raise ValueError(f"{num_examples} example(s) cannot be split into training and evaluation data")
    count = min(max(1, math.ceil(share * num_examples)), num_examples - 1)
    digest = hashlib.sha256(f"jobgen-eval-split:{seed}:{num_examples}".encode()).digest()
    order = np.random.RandomState(int.from_bytes(digest[:4], "little")).permutation(num_examples)
    return np.sort(order[count:]), np.sort(order[:count])


def split_digest(indices: np.ndarray) -> str:
    """What a checkpoint records of the held-out examples, to refuse a resume that would differ."""
    return hashlib.sha256(np.ascontiguousarray(indices, dtype=np.int64).tobytes()).hexdigest()[:16]


def load_eval_path(
    spec: ResolvedSpec,
    tokenizer: PreTrainedTokenizerBase,
    rank: int,
    share: Callable[[object], object],
    nodes: Nodes | None = None,
) -> Examples | None:
    """The tokenized ``[eval] path`` (collective, like the training data: prepared by the nodes
    in the data cache, every rank loads it), or None without one. Its errors name ``eval.path``."""
    from trainer.data.cache import cache_root, cache_sharing
    from trainer.data.collective import prepare_dataset

    eval_spec, data_spec = spec.run.eval, spec.run.data
    if eval_spec is None or eval_spec.path is None or data_spec is None or spec.run.model is None:
        return None
    try:
        dataset, _stats, _entry = prepare_dataset(
            data_spec.model_copy(update={"path": eval_spec.path}),
            tokenizer,
            spec.run.model.path,
            cache_root(spec),
            rank=rank,
            share=share,
            sharing=cache_sharing(spec),
            nodes=nodes,
        )
    except DataError as exc:
        # The data module words its errors for data.path; here the file is the validation set.
        text = str(exc).removeprefix("data.path: ")
        raise DataError(f"eval.path (read as [data] format '{data_spec.format}'): {text}") from None
    return dataset


def split_off_eval(
    spec: ResolvedSpec, dataset: Examples, eval_dataset: Examples | None
) -> tuple[Examples, Examples | None, dict[str, Any] | None]:
    """(training examples, evaluation examples or None, the split's record for checkpoints):
    with ``[eval] split`` the held-out examples leave the training set."""
    eval_spec = spec.run.eval
    if eval_spec is None or eval_spec.split is None:
        return dataset, eval_dataset, None
    try:
        train_idx, eval_idx = held_out(len(dataset), eval_spec.split, spec.run.train.seed)
    except ValueError as exc:
        raise DataError(f"eval.split: {exc}") from None
    record = {"share": eval_spec.split, "examples": len(eval_idx), "digest": split_digest(eval_idx)}
    return dataset.select(train_idx), dataset.select(eval_idx), record


@dataclass(frozen=True)
class EvalBatch:
    """One forward's worth of evaluation rows on this rank; ``real`` is False for a masked filler.
    ``source``: the index of the source its rows come from (a batch holds one source's rows)."""

    batch: dict[str, torch.Tensor]
    real: bool
    source: int = 0


class EvalSet:
    """The evaluation rows and this rank's share of their micro-batches. ``parts``: (name,
    examples) of each source; a batch never mixes two, so each source's loss is summed apart."""

    def __init__(
        self,
        parts: list[tuple[str, Examples]],
        *,
        max_length: int,
        packing: bool,
        pad_token_id: int,
        micro_batch_size: int,
        max_batches: int,
        world_size: int,
        rank: int,
    ):
        self.names = [name for name, _examples in parts]
        self.packing = packing
        self.pad_token_id = pad_token_id
        self.world_size, self.rank = world_size, rank
        self.micro_batch_size = micro_batch_size
        self.examples = self.tokens = 0
        # (source, the rows of one micro-batch) in order; ``max_batches`` cuts each source alike.
        self.plan: list[tuple[int, list[list[int]]]] = []
        self.datasets = [examples for _name, examples in parts]
        for index, (_name, dataset) in enumerate(parts):
            lengths = dataset.lengths()
            rows = build_rows(lengths, max_length, packing)
            # Longest first: consecutive rows have similar lengths, so a padded batch wastes little.
            firsts = np.array([rows[r][0] for r in range(len(rows))], dtype=np.int64)
            order = np.lexsort((firsts, -rows.tokens(lengths))).tolist()
            starts = range(0, len(order), micro_batch_size)
            batches = [[rows[r] for r in order[k : k + micro_batch_size]] for k in starts]
            self.plan += [(index, batch) for batch in batches[: max_batches or None]]
            self.examples += len(lengths)
            self.tokens += int(lengths.sum())
        self.num_batches = len(self.plan)
        # Every rank runs the same number of forwards: one per round of world_size batches.
        self.rounds = math.ceil(self.num_batches / world_size)

    def batches(self) -> Iterator[EvalBatch]:
        """This rank's micro-batches, one per round, a masked filler where it has none."""
        for round_ in range(self.rounds):
            k = round_ * self.world_size + self.rank
            if k < self.num_batches:
                source, rows = self.plan[k]
                yield EvalBatch(self._collate(source, rows), True, source)
            else:
                filler = self._collate(*self.plan[0])
                filler["labels"] = torch.full_like(filler["labels"], IGNORE_INDEX)
                yield EvalBatch(filler, False)

    def _collate(self, source: int, rows: list[list[int]]) -> dict[str, Any]:
        picked = fetch_rows(self.datasets[source], rows, range(len(rows)))
        batch = collate(picked, pad_token_id=self.pad_token_id, packing=self.packing)
        batch["num_tokens"] = torch.tensor(sum(len(ex["input_ids"]) for row in picked for ex in row))
        return batch

    def describe(self) -> str:
        rows = sum(len(rows) for _source, rows in self.plan)
        per = f" of {len(self.names)} sources" if len(self.names) > 1 else ""
        return (
            f"{self.examples} examples{per} in {rows} rows, {self.num_batches} batches of "
            f"{self.micro_batch_size} rows over {self.world_size} rank(s)"
        )


def eval_set_for(
    spec: ResolvedSpec,
    parts: list[tuple[str, Examples | None]],
    pad_token_id: int,
    *,
    world_size: int,
    rank: int,
) -> EvalSet | None:
    """The run's evaluation set on this rank (None without ``[eval]`` or examples): each
    source's held-out examples (``parts``: name, examples or None), cut like training's rows
    (data.max_length, data.packing), in ``[eval] micro_batch_size`` rows (default
    train.micro_batch_size), up to ``[eval] max_batches`` of each source."""
    eval_spec, data_spec = spec.run.eval, spec.run.data
    given = [(name, examples) for name, examples in parts if examples is not None]
    if eval_spec is None or not given or data_spec is None:
        return None
    return EvalSet(
        given,
        max_length=data_spec.max_length,
        packing=data_spec.packing,
        pad_token_id=pad_token_id,
        micro_batch_size=eval_spec.micro_batch_size or spec.run.train.micro_batch_size,
        max_batches=eval_spec.max_batches,
        world_size=world_size,
        rank=rank,
    )
