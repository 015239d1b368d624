"""The trainer's data in one call, :func:`training_data`: the tokenizer, the run's examples
tokenized (through the shared cache), the evaluation set, the rows packed, and this rank's
sampler, as one :class:`DataPipeline`.

That pipeline is the Trainer's one handle on data: the next micro-batch, and a
``state_dict`` that is the sampler's position, the same on every rank, so a resumed run
continues with exactly the rows it had not yet seen. :func:`model_inputs_on` turns a
micro-batch into the model's keyword arguments on a device (the step runners' and the
evaluator's way in).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from jobgen.spec.global_batch import grad_accum_for
from jobgen.spec.resolved import ResolvedSpec
from trainer.data.cache import cache_root, cache_sharing
from trainer.data.collective import Nodes, prepare_dataset
from trainer.data.eval_set import eval_set_for, load_eval_path, split_off_eval
from trainer.data.packing import build_rows, collate, fetch_rows, fill_ratio, model_inputs
from trainer.data.sampler import ResumableSampler, ResumeMismatch
from trainer.distributed import DistEnv
from trainer.model.prep import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.data.examples import Examples
    from trainer.data.stats import DataStats

log = logging.getLogger("trainer.data.batches")

# Tokenizing a large dataset on rank 0 can take far longer than a collective timeout.
PREPROCESS_TIMEOUT = dt.timedelta(hours=6)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``. To a GPU through pinned memory and without blocking: the copy
    runs on the DMA engine, ordered on the current stream before the kernels that read it,
    while the host goes on queueing them. Unchanged on CPU."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def model_inputs_on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """The forward's keyword arguments of a micro-batch (:func:`trainer.data.packing.model_inputs`,
    without the ``num_tokens`` count), its tensors on ``device``."""
    inputs = model_inputs({k: v for k, v in batch.items() if k != "num_tokens"})
    return {k: to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def training_data(spec: ResolvedSpec, env: DistEnv, shard: tuple[int, int]) -> DataPipeline:
    """The data phase of the trainer's start, collective (every rank calls it once): the
    model's tokenizer, then everything :class:`DataPipeline` builds from it. ``shard``: (rank,
    size) of the training sampler, as the parallelism's ``Strategy.data_shard`` says."""
    assert spec.run.model is not None
    return DataPipeline(spec, load_tokenizer(spec.run.model.path), env, shard=shard)


def _tokenized(
    spec: ResolvedSpec, tokenizer: PreTrainedTokenizerBase, env: DistEnv
) -> tuple[Examples, DataStats, Path, Examples | None]:
    """(the training examples, what preprocessing did, their cache entry, the tokenized
    ``[eval] path`` or None): rank 0 prepares both in the data cache, every rank loads them."""
    data_spec, model_spec = spec.run.data, spec.run.model
    assert data_spec is not None and model_spec is not None
    # Its own gloo group: rank 0 may tokenize for hours while the others wait in the broadcast.
    group = dist.new_group(backend="gloo", timeout=PREPROCESS_TIMEOUT)

    def share(value: object) -> object:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def gather(value: object) -> list:
        every: list = [None] * env.world_size
        dist.all_gather_object(every, value, group=group)
        return every

    # The first rank of every node tokenizes a share of the shards with its node's CPUs.
    nodes = Nodes(gather, first_on_node=env.local_rank == 0, name=Nodes.node_name())

    try:
        dataset, stats, entry = prepare_dataset(
            data_spec,
            tokenizer,
            model_spec.path,
            cache_root(spec),
            rank=env.rank,
            share=share,
            sharing=cache_sharing(spec),
            nodes=nodes,
        )
        # [eval] path: read like the training data (format, template, masks, max_length), cached alike.
        eval_source = load_eval_path(spec, tokenizer, env.rank, share, nodes)
    finally:
        dist.destroy_process_group(group)
    return dataset, stats, entry, eval_source


class DataPipeline:
    """The run's data on this rank: its micro-batches in a resumable order, and its evaluation set."""

    def __init__(
        self,
        spec: ResolvedSpec,
        tokenizer: PreTrainedTokenizerBase,
        env: DistEnv,
        run_dir: Path | None = None,
        shard: tuple[int, int] | None = None,
    ):
        """``shard``: (rank, size) of the training sampler, the replica's when several ranks
        share rows (a pipeline's stages); default this rank of the world. ``run_dir`` is not
        read (the data lives in the cache, trainer.data.cache); it is accepted from the callers
        that pass it."""
        data_spec, train = spec.run.data, spec.run.train
        assert data_spec is not None
        self.tokenizer = tokenizer
        self.packing: bool = data_spec.packing
        self.pad_token_id: int = tokenizer.pad_token_id
        dataset, self.stats, self.entry, eval_source = _tokenized(spec, tokenizer, env)
        self.dataset, eval_dataset, self.split = split_off_eval(spec, dataset, eval_source)
        self.eval_set = eval_set_for(spec, eval_dataset, self.pad_token_id, world_size=env.world_size, rank=env.rank)
        lengths = self.dataset.column("length")
        self.rows = build_rows(lengths, data_spec.max_length, self.packing)
        shard_rank, shard_size = shard if shard is not None else (env.rank, env.world_size)
        self.sampler = ResumableSampler(
            len(self.rows),
            world_size=shard_size,
            rank=shard_rank,
            micro_batch_size=train.micro_batch_size,
            seed=train.seed,
            grad_accum=grad_accum_for(train, env.world_size),
        )
        if env.is_main:
            self._log_summary(lengths, data_spec.max_length)

    def _log_summary(self, lengths: Sequence[int], max_length: int) -> None:
        """Rank 0: what preprocessing and packing made of the data, and the evaluation set."""
        log.info("data: %s (cache %s)", self.stats.summary(), self.entry)
        if self.stats.truncated:
            log.warning(
                "data: %d of %d examples were longer than max_length=%d and were truncated",
                self.stats.truncated,
                self.stats.examples_in,
                max_length,
            )
        if self.eval_set is not None:
            log.info("eval: %s", self.eval_set.describe())
        if self.packing:
            log.info(
                "data: %d examples packed into %d rows (%.0f%% full)",
                len(lengths),
                len(self.rows),
                100 * fill_ratio(self.rows, lengths, max_length),
            )

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's next micro-batch; ``num_tokens`` counts its non-padding tokens."""
        rows = fetch_rows(self.dataset, self.rows, self.sampler.next_batch())
        batch = collate(rows, pad_token_id=self.pad_token_id, packing=self.packing)
        batch["num_tokens"] = torch.tensor(sum(len(ex["input_ids"]) for row in rows for ex in row))
        return batch

    def state_dict(self) -> dict[str, Any]:
        state = self.sampler.state_dict()
        if self.split is not None:
            state["eval_split"] = self.split
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        recorded = state.get("eval_split")
        if recorded is not None and recorded != self.split:
            raise ResumeMismatch(
                f"the checkpoint held out {recorded} for evaluation, this run holds out {self.split}: "
                "the data, eval.split or the seed changed, so it would train on other examples"
            )
        self.sampler.load_state_dict(state)

    def stats_dict(self) -> dict[str, Any]:
        return {**self.stats.to_dict(), "rows": len(self.rows), "packing": self.packing}
