"""Chunked linear cross-entropy: the loss without the float32 logits of the whole sequence.

``[train] loss_chunk_tokens = N`` sends the final hidden states through the output
layer N tokens at a time. Each chunk's logits are cast to float32, scored with
cross-entropy (summed over target tokens), and dropped; backward recomputes them one
chunk at a time (``torch.utils.checkpoint``, non-reentrant), so the peak is one
chunk's logits, not ``tokens x vocabulary``. The result equals
:func:`trainer.data.packing.token_loss_sum` up to the order of the sum.

Why inside the model's forward
    FSDP2 un-shards the output layer's weight (an FSDP unit of its own, or part of the
    root's when tied to the input embeddings) only inside that unit's forward (and again
    for its backward). So the chunked loss must run where the logits are computed: the output
    layer's class is swapped (:func:`install_chunked_loss`) for :class:`ChunkedLossHead`,
    an ``nn.Linear`` whose forward, while :meth:`ChunkedLoss.targets` has given it the
    labels, returns the loss sum shaped ``(1, 1, 1)`` in place of the logits. The
    parameters stay the same objects under the same names: checkpoints are unchanged
    and tied input/output embeddings stay tied.

When it cannot apply
    The swap relies on the model returning its output layer's result as is (Llama,
    Qwen, Mistral and most decoders in transformers 5: ``logits = self.lm_head(h)``).
    A model whose output layer is not a plain ``nn.Linear`` (LoRA on it, quantised
    layers) is refused by :func:`install_chunked_loss`; one that changes the logits
    after the output layer (soft-capping, scaling) is refused there when its config
    says so, else by :meth:`ChunkedLoss.loss_sum` on the first step, which checks that
    the value the model returned is the loss the head computed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.data.packing import IGNORE_INDEX
from trainer.model.errors import ModelError

# Config keys of transformers models that post-process the output layer's logits.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


# What a user sets to get the plain path: every position's logits, all at once.
TURN_OFF = "set train.loss_chunk_tokens = 0 and train.target_logits_only = false"


class LossHeadError(ModelError):
    """The chunked loss cannot be used with this model; the message says why and what to set.
    A ModelError: raised while the trainer is built, the job ends as for any untrainable model."""


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_tokens: int,
    *,
    targets_only: bool = False,
) -> torch.Tensor:
    """Next-token cross-entropy of ``F.linear(hidden, weight, bias)`` summed over target
    tokens (a 0-d float32 tensor).

    ``hidden`` is ``[batch, seq, dim]``, ``labels`` ``[batch, seq]`` unshifted as
    :func:`trainer.data.packing.token_loss_sum` takes them: position ``t`` predicts
    ``labels[:, t + 1]``. ``targets_only`` first keeps the positions that have a target
    (the others contribute nothing to the loss, so their logits are never computed).
    ``chunk_tokens`` > 0 computes the logits that many positions at a time and recomputes
    each chunk's in backward; chunks without a target are skipped. Whatever is skipped, the
    result stays connected to the graph, so that every parameter gets a gradient.
    """
    if chunk_tokens < 0:
        raise ValueError("chunk_tokens must not be negative")
    if hidden.shape[:-1] != labels.shape:
        raise LossHeadError(
            f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}: "
            "the model did not send every position through its output layer"
        )
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    # Which positions hold a target, decided on the host (labels come from the CPU batch): no
    # device synchronisation for it.
    host_targets = targets.detach().cpu()
    flat = hidden.reshape(-1, hidden.size(-1))
    if targets_only:
        positions = (host_targets != IGNORE_INDEX).nonzero().squeeze(1)
        if positions.numel() == 0:
            positions = torch.zeros(1, dtype=torch.long)  # an ignored position: a zero loss on the graph
        flat = flat.index_select(0, positions.to(flat.device, non_blocking=True))
        host_targets = host_targets[positions]
    targets = host_targets.to(hidden.device, non_blocking=True)
    if chunk_tokens == 0:
        return _chunk_loss(flat, weight, bias, targets)
    has_target = (host_targets != IGNORE_INDEX).split(chunk_tokens)
    pieces = list(zip(flat.split(chunk_tokens), targets.split(chunk_tokens), has_target))
    chosen = [(h, y) for h, y, any_target in pieces if bool(any_target.any())] or [pieces[0][:2]]
    total: torch.Tensor | None = None
    for h, y in chosen:
        # Non-reentrant: autocast is recorded and replayed; no RNG in here to preserve.
        part = checkpoint(_chunk_loss, h, weight, bias, y, use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    assert total is not None
    return total


class ChunkedLossHead(nn.Linear):
    """An output layer that returns the chunked loss sum, shaped ``(1, 1, 1)``, while
    :meth:`ChunkedLoss.targets` has set its labels, and plain logits otherwise. Made by
    swapping an ``nn.Linear``'s class (:func:`install_chunked_loss`); never constructed."""

    chunk_tokens: int
    targets_only: bool
    loss_labels: torch.Tensor | None
    calls: int
    last_loss: torch.Tensor | None
    model_name: str

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        labels = self.loss_labels
        if labels is None:
            return super().forward(hidden)
        self.calls += 1
        loss = chunked_linear_cross_entropy(
            hidden, self.weight, self.bias, labels, self.chunk_tokens, targets_only=self.targets_only
        )
        self.last_loss = loss.detach()
        return loss.reshape(1, 1, 1).clone()  # not a view: FSDP2 hooks its unit's output for backward


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP and peft wrappers (FSDP2 wraps in place)."""
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):  # peft.PeftModel
        model = model.get_base_model()
    return model


class ChunkedLoss:
    """The installed chunked loss of one model: set the labels around its forward with
    :meth:`targets`, then turn what the forward returned as logits into the loss sum with
    :meth:`loss_sum`."""

    def __init__(self, head: ChunkedLossHead):
        self.head = head

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor) -> Iterator[None]:
        head = self.head
        head.loss_labels, head.calls, head.last_loss = labels, 0, None
        try:
            yield
        finally:
            head.loss_labels = None

    def loss_sum(self, output: torch.Tensor) -> torch.Tensor:
        """The loss sum (0-d, float32) from the model output's ``logits``, after checking that
        the model returned the head's result untouched."""
        head = self.head
        if head.calls != 1 or head.last_loss is None:
            raise LossHeadError(
                f"the model called its output layer {head.calls} times in one forward (expected once); "
                f"{TURN_OFF} for this architecture"
            )
        own = head.last_loss
        if tuple(output.shape) != (1, 1, 1) or not _same_value(output.detach().reshape(()), own):
            raise LossHeadError(
                f"{head.model_name} changes its output layer's result before returning "
                "it (e.g. logit soft-capping or scaling), so the chunked loss cannot stand in for the logits; "
                f"{TURN_OFF} for this architecture"
            )
        return output.reshape(())


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float(), b.float()
    return bool(torch.equal(a, b) or (torch.isnan(a) & torch.isnan(b)).item())


def _fsdp_unit_of_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` that FSDP2's ``fully_shard`` made a unit of
    its own (:func:`trainer.parallel.build.wrap` does so for untied output layers): its class is then
    ``FSDPLinear(FSDPModule, nn.Linear)``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule) and type(module).__bases__ == (FSDPModule, nn.Linear)


@functools.cache
def _fsdp_chunked_loss_head() -> type:
    """``FSDPChunkedLossHead(FSDPModule, ChunkedLossHead)``: the class FSDP2 itself would give a
    ChunkedLossHead, so the head stays an FSDPModule (the root's gradient-sync and reshard
    calls reach it) and computes the loss."""
    from torch.distributed.fsdp import FSDPModule

    return type("FSDPChunkedLossHead", (FSDPModule, ChunkedLossHead), {})


def install_chunked_loss(model: nn.Module, chunk_tokens: int, *, targets_only: bool = False) -> ChunkedLoss:
    """Swap the output layer of ``model`` (bare, DDP-, FSDP2- or peft-wrapped) for a
    :class:`ChunkedLossHead` computing the loss ``chunk_tokens`` tokens at a time.
    Raises :class:`LossHeadError` for architectures where that cannot be done."""
    inner = unwrap(model)
    name = type(inner).__name__
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise LossHeadError(
            f"{name} has no output embeddings (get_output_embeddings() is None): {TURN_OFF} for this model"
        )
    fsdp_unit = _fsdp_unit_of_linear(head)
    if type(head) is not nn.Linear and not fsdp_unit:
        raise LossHeadError(
            f"{name}'s output layer is a {type(head).__module__}.{type(head).__name__}, not a plain "
            "torch.nn.Linear (LoRA or quantisation on it?): the chunked loss cannot replace it; "
            f"{TURN_OFF}"
        )
    config = getattr(inner, "config", None)
    for key in _LOGIT_POSTPROCESSING:
        value = getattr(config, key, None)
        if value not in (None, 1, 1.0, False):
            raise LossHeadError(
                f"{name} post-processes its logits ({key} = {value!r} in its config), which the chunked loss "
                f"would skip: {TURN_OFF} for this model"
            )
    head.__class__ = _fsdp_chunked_loss_head() if fsdp_unit else ChunkedLossHead
    head.chunk_tokens = chunk_tokens
    head.targets_only = targets_only
    head.loss_labels = None
    head.calls = 0
    head.last_loss = None
    head.model_name = name
    return ChunkedLoss(head)


def loss_head_for(model: nn.Module, chunk: int, targets_only: bool) -> ChunkedLoss | None:
    """The loss computed inside the output layer (chunked, or at target positions only), or
    None for the plain path (every position's logits). Asked for chunking, a model that
    cannot have it is refused; target positions only falls back to the plain path."""
    log = logging.getLogger("trainer")
    if not chunk and not targets_only:
        return None
    try:
        loss = install_chunked_loss(model, chunk, targets_only=targets_only)
    except LossHeadError as exc:
        if chunk:
            raise
        log.info("output layer: every position's logits (%s)", exc)
        return None
    log.info(
        "output layer: the loss inside it, %s, %s",
        "at target positions only" if targets_only else "at every position",
        f"{chunk} tokens at a time" if chunk else "all at once",
    )
    return loss
