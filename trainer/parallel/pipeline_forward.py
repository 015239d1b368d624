"""Forward only through a pipeline's stages, whatever schedule trains them: what evaluation and
samples run under ``train.parallelism = "pipeline"``.

    forward = StagesForward(module, layout, pp_group)
    logits = forward(input_ids, position_ids, attention_mask)   # on the last stage; None elsewhere
    token = forward.greedy_token(ids)                            # every rank of the pipeline

Why not the training schedule's own ``eval()``: the schedules fix their micro-batch count and
their activation shapes, ask for at least as many micro-batches as stages (1F1B, the zero-bubble
ones) and place stages in loops or in V's; an evaluation's batches have their own rows and
lengths, and a sample grows by one token at a time. Here the whole batch goes through stage 0,
then 1, ... in order, each rank running the stages it holds (a V placement's two as well) and
handing the hidden states to the rank of the next stage (its shape first, then the tensor, by
point-to-point send and receive in the pipeline's own replica). Under ``torch.no_grad`` nothing
is kept for a backward. The ranks of a stage's other replicas do the same with their own
batches at the same time, so FSDP's gathers over the replicas line up as in training.

Equal to the unpipelined forward: each stage view runs the same blocks with the same masks and
positions (trainer.parallel.pipeline._StageView); the loss is summed by the same function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from jobgen.model.pipeline_split import stage_positions
from trainer.parallel.pipeline import StageModule

# The dtypes hidden states travel in (whatever autocast or FSDP's mixed precision made them).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class StagesForward:
    """The forward of a whole batch through every stage of this rank's pipeline, in order."""

    def __init__(self, module: StageModule, schedule: str, pp_size: int, pp_rank: int, dp_size: int, dp_rank: int):
        self.module = module
        self.stages = module.num_stages
        # The global rank holding each stage in this rank's replica (rank r = pp_rank * dp + dp_rank).
        self.owners = [p * dp_size + dp_rank for p in stage_positions(schedule, pp_size, self.stages)]
        self.rank = pp_rank * dp_size + dp_rank
        self.last = self.owners[-1]

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The last stage's output (the logits) on the rank holding it; None on the others."""
        hidden: torch.Tensor | None = None
        for stage in range(self.stages):
            owner = self.owners[stage]
            if owner != self.rank:
                continue
            if stage == 0:
                x = input_ids
            elif self.owners[stage - 1] == self.rank:
                assert hidden is not None
                x = hidden
            else:
                x = self._receive(self.owners[stage - 1], input_ids.device)
            kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
            hidden = self.module.stage_view(stage)(x, position_ids, **kwargs)
            following = self.owners[stage + 1] if stage + 1 < self.stages else None
            if following is not None and following != self.rank:
                self._send(hidden, following)
        return hidden if self.rank == self.last else None

    def greedy_token(self, ids: torch.Tensor) -> int:
        """The next token of the one row ``ids`` [1, length] (every rank of the pipeline passes
        the same ids): the last stage's argmax, sent to every rank of the pipeline."""
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        logits = self(ids, positions)
        chosen = torch.zeros(1, dtype=torch.long, device=ids.device)
        if logits is not None:
            chosen[0] = logits[0, -1].argmax()
        for rank in sorted(set(self.owners)):
            if rank == self.last:
                continue
            if self.rank == self.last:
                dist.send(chosen, rank)
            elif self.rank == rank:
                dist.recv(chosen, self.last)
        return int(chosen.item())

    def _send(self, hidden: torch.Tensor, to: int) -> None:
        """Its number of dimensions and dtype, its shape, then the tensor."""
        device = hidden.device
        dist.send(torch.tensor([hidden.ndim, DTYPES.index(hidden.dtype)], dtype=torch.long, device=device), to)
        dist.send(torch.tensor(hidden.shape, dtype=torch.long, device=device), to)
        dist.send(hidden.contiguous(), to)

    def _receive(self, source: int, device: torch.device) -> torch.Tensor:
        header = torch.zeros(2, dtype=torch.long, device=device)
        dist.recv(header, source)
        shape = torch.zeros(int(header[0]), dtype=torch.long, device=device)
        dist.recv(shape, source)
        hidden = torch.empty(tuple(shape.tolist()), dtype=DTYPES[int(header[1])], device=device)
        dist.recv(hidden, source)
        return hidden
