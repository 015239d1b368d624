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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from jobgen.spec.global_batch import grad_accum_for
from jobgen.spec.resolved import ResolvedSpec
from trainer.data.cache import cache_root, cache_sharing
from trainer.data.collective import Nodes, prepare_dataset
from trainer.data.eval_set import eval_set_for, load_eval_path, split_off_eval
from trainer.data.formats import DataError
from trainer.data.packing import Rows, build_rows, collate, fetch_rows, fill_ratio, model_inputs
from trainer.data.sampler import (
    MixtureError,
    MixtureSampler,
    MixtureSource,
    ResumableSampler,
    ResumeMismatch,
    mixture_shares,
)
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


@dataclass
class SourceData:
    """One source of the run's data on this rank: its examples, cache entry and what
    preprocessing did, the examples held out for evaluation, and the rows it trains on."""

    name: str
    amount: tuple[float | None, float | None]  # (weight, epochs) of a mixture's source
    examples: Examples
    stats: DataStats
    entry: Path
    split: dict[str, Any] | None = None
    eval_examples: Examples | None = None
    rows: Rows = field(default_factory=lambda: Rows(0))
    row_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # per row


def _tokenized(spec: ResolvedSpec, tokenizer: PreTrainedTokenizerBase, env: DistEnv) -> list[SourceData]:
    """Every source of the run, tokenized: the nodes prepare each in the data cache (its own
    entry, so a source added to a mixture is the only one tokenized), every rank loads them; with
    ``[eval] path``, the tokenized evaluation file is the one source's held-out examples."""
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
    amounts = {s.display_name(): (s.weight, s.epochs) for s in data_spec.sources or []}
    sources = []
    try:
        for prefix, name, source_spec in data_spec.source_specs():
            try:
                examples, stats, entry = prepare_dataset(
                    source_spec,
                    tokenizer,
                    model_spec.path,
                    cache_root(spec),
                    rank=env.rank,
                    share=share,
                    sharing=cache_sharing(spec),
                    nodes=nodes,
                )
            except DataError as exc:
                raise exc.for_source(prefix) from None
            sources.append(SourceData(name, amounts.get(name, (1.0, None)), examples, stats, entry))
        # [eval] path: read like the training data (format, template, masks, max_length), cached alike.
        eval_source = load_eval_path(spec, tokenizer, env.rank, share, nodes)
    finally:
        dist.destroy_process_group(group)
    for source in sources:
        source.examples, source.eval_examples, source.split = split_off_eval(spec, source.examples, eval_source)
    return sources


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
        self.sources = _tokenized(spec, tokenizer, env)
        for source in self.sources:
            lengths = source.examples.lengths()
            source.rows = build_rows(lengths, data_spec.max_length, self.packing)
            source.row_tokens = source.rows.tokens(lengths)
        self.mixture = data_spec.sources is not None
        self.tokens_drawn = [0] * len(self.sources)
        shard_rank, shard_size = shard if shard is not None else (env.rank, env.world_size)
        # Shared out like the training rows: a pipeline's stages run their replica's batches.
        self.eval_set = eval_set_for(
            spec,
            [(s.name, s.eval_examples) for s in self.sources],
            self.pad_token_id,
            world_size=shard_size,
            rank=shard_rank,
        )
        batch = {
            "world_size": shard_size,
            "rank": shard_rank,
            "micro_batch_size": train.micro_batch_size,
            "seed": train.seed,
            "grad_accum": grad_accum_for(train, env.world_size),
        }
        self.sampler: ResumableSampler | MixtureSampler
        self.run_rows = train.max_steps * shard_size * batch["micro_batch_size"] * batch["grad_accum"]
        if self.mixture:
            self.sampler = MixtureSampler(self._mixture(spec), **batch)
        else:
            self.sampler = ResumableSampler(len(self.sources[0].rows), **batch)
        if env.is_main:
            self._log_summary(data_spec.max_length)

    @property
    def entry(self) -> Path:
        """The first (with ``data.path``, the one) source's cache entry."""
        return self.sources[0].entry

    @property
    def rows(self) -> Rows:
        """The first (with ``data.path``, the one) source's rows."""
        return self.sources[0].rows

    def _mixture(self, spec: ResolvedSpec) -> list[MixtureSource]:
        """The sources as the mixture sampler draws them, their shares from weights and epochs."""
        try:
            shares = mixture_shares(
                [(s.name, *s.amount) for s in self.sources],
                [len(s.rows) for s in self.sources],
                [int(s.row_tokens.sum()) for s in self.sources],
                self.run_rows,
            )
        except MixtureError as exc:
            raise DataError(f"data.sources: {exc}") from None
        return [MixtureSource(s.name, len(s.rows), share) for s, share in zip(self.sources, shares, strict=True)]

    def _log_summary(self, max_length: int) -> None:
        """Rank 0: what preprocessing and packing made of the data, and the evaluation set."""
        for source in self.sources:
            stats = source.stats
            log.info("data: %s: %s (cache %s)", source.name, stats.summary(), source.entry)
            if stats.truncated:
                log.warning(
                    "data: %s: %d of %d examples were longer than max_length=%d and were truncated",
                    source.name,
                    stats.truncated,
                    stats.examples_in,
                    max_length,
                )
            if self.packing:
                log.info(
                    "data: %s: %d examples packed into %d rows (%.0f%% full)",
                    source.name,
                    len(source.examples),
                    len(source.rows),
                    100 * fill_ratio(source.row_tokens, max_length),
                )
        if isinstance(self.sampler, MixtureSampler):
            drawn = [float(m.share) * float(s.row_tokens.mean()) for s, m in zip(self.sources, self.sampler.sources)]
            for source, mixed, tokens in zip(self.sources, self.sampler.sources, drawn, strict=True):
                log.info(
                    "data: mixture: %s: %.1f%% of the rows, %.1f%% of the tokens (%.2f epochs in train.max_steps)",
                    source.name,
                    100 * float(mixed.share),
                    100 * tokens / sum(drawn),
                    float(mixed.share) * self.run_rows / len(source.rows),
                )
        if self.eval_set is not None:
            log.info("eval: %s", self.eval_set.describe())

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's next micro-batch; ``num_tokens`` counts its non-padding tokens."""
        if isinstance(self.sampler, MixtureSampler):
            picked = self.sampler.next_batch()
            rows = [fetch_rows(self.sources[s].examples, self.sources[s].rows, [row])[0] for s, row in picked]
            for s, row in self.sampler.last_slots:  # every rank's rows: the counts are the run's
                self.tokens_drawn[s] += int(self.sources[s].row_tokens[row])
        else:
            only = self.sources[0]
            rows = fetch_rows(only.examples, only.rows, self.sampler.next_batch())
        batch = collate(rows, pad_token_id=self.pad_token_id, packing=self.packing)
        batch["num_tokens"] = torch.tensor(sum(len(ex["input_ids"]) for row in rows for ex in row))
        return batch

    def drawn(self) -> dict[str, Any]:
        """A mixture's tokens drawn so far per source, for the metrics line; {} for one source."""
        if not self.mixture:
            return {}
        return {"source_tokens": {s.name: n for s, n in zip(self.sources, self.tokens_drawn, strict=True)}}

    def state_dict(self) -> dict[str, Any]:
        state = self.sampler.state_dict()
        splits = [s.split for s in self.sources]
        if self.mixture:
            state["tokens_drawn"] = list(self.tokens_drawn)
            if any(splits):
                state["eval_split"] = splits
        elif splits[0] is not None:
            state["eval_split"] = splits[0]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        recorded = state.get("eval_split")
        split = [s.split for s in self.sources] if self.mixture else self.sources[0].split
        if recorded is not None and recorded != split:
            raise ResumeMismatch(
                f"the checkpoint held out {recorded} for evaluation, this run holds out {split}: "
                "the data, eval.split or the seed changed, so it would train on other examples"
            )
        self.sampler.load_state_dict(state)
        if self.mixture:
            self.tokens_drawn = [int(n) for n in state.get("tokens_drawn", [0] * len(self.sources))]

    def stats_dict(self) -> dict[str, Any]:
        if not self.mixture:
            only = self.sources[0]
            return {**only.stats.to_dict(), "rows": len(only.rows), "packing": self.packing}
        return {
            "packing": self.packing,
            "sources": {s.name: {**s.stats.to_dict(), "rows": len(s.rows)} for s in self.sources},
        }
