"""Held-out evaluation during training, the record of every evaluation, and early stopping.

An evaluation is the mean next-token loss over every target token of the evaluation set
on all ranks (token-weighted like the training loss, so the same number on 1 or 16
ranks), its perplexity and its token counts. It runs in eval mode without gradients,
touches no RNG stream, the sampler or the optimizer, so the training that follows is
the one it would have been without it.

Each round of micro-batches ends with one small all-reduce of the ranks' stop actions:
a kill switch, signal, deadline or memory guard during an evaluation abandons it at once
(nothing recorded) and the loop saves and exits as it would at a step boundary.

:class:`EvalHistory` is part of the trainer's checkpointed state: every evaluation's
(step, loss). The best evaluation, the evaluations since it (early stopping's count) and
the best checkpoint are derived from it, so they survive requeues and resumes exactly and
are recomputed when a checkpoint is set aside.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from jobgen.runs.jsonl_records import EVAL_EVENT
from jobgen.runtime.stopping import Action, StopMonitor
from trainer.data.eval_set import EvalSet
from trainer.data.packing import count_targets
from trainer.distributed import DistEnv, mark_progress, reduce_max, reduce_sum

log = logging.getLogger("trainer.eval")

# Seconds between the progress lines of a long evaluation.
PROGRESS_EVERY_S = 60.0


@dataclass(frozen=True)
class EvalResult:
    step: int
    loss: float
    target_tokens: int
    tokens: int
    seconds: float
    batches: int
    source_losses: dict[str, float] | None = None  # a mixture's held-out loss of each source

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line (with ``event = "eval"``)."""
        return {
            "event": EVAL_EVENT,
            "step": self.step,
            "eval_loss": self.loss,
            "eval_ppl": self.perplexity,
            "eval_tokens": self.target_tokens,
            "eval_all_tokens": self.tokens,
            "eval_batches": self.batches,
            "eval_seconds": round(self.seconds, 4),
            "eval_target_tokens_per_s": round(self.target_tokens / max(self.seconds, 1e-9), 2),
            **({"eval_source_losses": self.source_losses} if self.source_losses else {}),
        }


class EvalHistory:
    """Every evaluation of the run so far, in step order; the trainer checkpoints it."""

    def __init__(self, min_delta: float = 0.0):
        self.min_delta = min_delta
        self.evals: list[tuple[int, float]] = []

    def add(self, step: int, loss: float) -> bool:
        """Record an evaluation; True if it is the new best."""
        self.evals.append((step, loss))
        best = self.best()
        return best is not None and best[0] == step

    def best(self) -> tuple[int, float] | None:
        """(step, loss) of the best evaluation: the first to beat every earlier best by more than
        ``min_delta`` (the rule early stopping counts against)."""
        best: tuple[int, float] | None = None
        for step, loss in self.evals:
            if best is None or loss < best[1] - self.min_delta:
                best = (step, loss)
        return best

    def since_best(self) -> int:
        """Evaluations after the best one: early stopping stops when this reaches patience."""
        best = self.best()
        return 0 if best is None else sum(1 for step, _ in self.evals if step > best[0])

    def lowest_among(self, steps: set[int]) -> tuple[int, float] | None:
        """(step, loss) of the lowest eval loss among evaluations at ``steps`` (the checkpoints on
        disk): the best checkpoint once the best one was set aside or pruned."""
        candidates = [(loss, step) for step, loss in self.evals if step in steps]
        if not candidates:
            return None
        loss, step = min(candidates)
        return step, loss

    @property
    def last_step(self) -> int | None:
        return self.evals[-1][0] if self.evals else None

    def state_dict(self) -> dict[str, Any]:
        return {"evals": [[step, loss] for step, loss in self.evals]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.evals = [(int(step), float(loss)) for step, loss in (state or {}).get("evals", [])]


class Evaluator:
    """Runs one evaluation on every rank together; owns when the next one is due."""

    def __init__(
        self,
        model: torch.nn.Module,
        eval_set: EvalSet,
        env: DistEnv,
        monitor: StopMonitor,
        forward_loss_sum: Callable[[dict[str, Any], torch.Tensor], torch.Tensor],
        model_inputs: Callable[[dict[str, torch.Tensor], torch.device], dict[str, Any]],
        *,
        every_steps: int,
        every_seconds: int,
        scores: bool = True,
    ):
        """``scores``: whether this rank's batches count (a pipeline's last stage scores its
        replica's batches; its other stages run them without a loss of their own)."""
        self.scores = scores
        self.model = model
        self.eval_set = eval_set
        self.env = env
        self.monitor = monitor
        self.forward_loss_sum = forward_loss_sum
        self.model_inputs = model_inputs
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.last_eval = time.monotonic()
        self.seconds: list[float] = []  # wall time of each evaluation of this job
        # The longest round of micro-batches: what a stop waits for before the evaluation is left.
        self.round_seconds_max = 0.0

    def wants_eval(self, step: int) -> bool:
        """This rank's view of an evaluation being due; rank-local (its own clock), so the loop
        combines every rank's view in its step-boundary all-reduce."""
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        by_time = self.every_seconds > 0 and time.monotonic() - self.last_eval >= self.every_seconds
        return by_steps or by_time

    def summary(self) -> dict[str, Any]:
        """This job's evaluation times, for metrics.json and the lead-time check."""
        return {
            "eval_seconds": [round(s, 3) for s in self.seconds],
            "eval_round_seconds_max": round(self.round_seconds_max, 3),
        }

    def run(self, step: int) -> tuple[EvalResult | None, Action]:
        """Evaluate on every rank; (the result, CONTINUE), or (None, the stop action) when a
        stop was asked for during it (the evaluation is then abandoned)."""
        started = time.time()
        device = self.env.device
        # Summed on the device in float64: one host synchronisation per evaluation, not per batch.
        # Per source (a batch holds one source's rows): loss, target tokens, tokens.
        sums = torch.zeros(len(self.eval_set.names), 3, dtype=torch.float64, device=device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        batches = 0
        self.model.eval()
        try:
            with torch.no_grad():
                round_started = reported = time.monotonic()
                for item in self.eval_set.batches():
                    inputs = self.model_inputs(item.batch, device)
                    with autocast:
                        summed = self.forward_loss_sum(inputs, item.batch["labels"])
                    if item.real and self.scores:
                        batches += 1
                        sums[item.source, 0] += summed.detach().double()
                        sums[item.source, 1] += float(count_targets(item.batch["labels"]))
                        sums[item.source, 2] += float(item.batch["num_tokens"])
                    (action,) = reduce_max(self.env, [int(self.monitor.local_action())])
                    mark_progress()
                    now = time.monotonic()
                    self.round_seconds_max = max(self.round_seconds_max, now - round_started)
                    round_started = now
                    if self.env.is_main and now - reported >= PROGRESS_EVERY_S:
                        # A long evaluation writes no metrics line: show it is alive (the hang
                        # watchdog reads the log's age too).
                        reported = now
                        done = min(batches * self.env.world_size, self.eval_set.num_batches)
                        log.info("eval at step %d: %d of %d batches", step, done, self.eval_set.num_batches)
                    if Action(action).exits:
                        return None, Action(action)
        finally:
            self.model.train()
            release_gathered(self.model)
            self.last_eval = time.monotonic()
        names = self.eval_set.names
        every = reduce_sum(self.env, [*sums.flatten().tolist(), float(batches)])
        per_source = [every[3 * i : 3 * i + 3] for i in range(len(names))]
        loss_sum, targets, tokens = (sum(values) for values in zip(*per_source, strict=True))
        by_source = {name: s[0] / max(s[1], 1.0) for name, s in zip(names, per_source, strict=True)}
        seconds = time.time() - started
        self.seconds.append(seconds)
        result = EvalResult(
            step,
            loss_sum / max(targets, 1.0),
            int(targets),
            int(tokens),
            seconds,
            int(every[-1]),
            by_source if len(names) > 1 else None,
        )
        return result, Action.CONTINUE


def release_gathered(model: torch.nn.Module) -> None:
    """Reshard FSDP2 units an evaluation's forward left gathered (those kept unsharded after
    forward, waiting for a backward that never comes), so their full parameters do not stay
    resident until the next training step."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # no FSDP2 in this torch: nothing can be gathered
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def eval_prompts(spec) -> list[str]:
    """``[eval] prompts`` followed by those of ``prompts_file`` (checked by ``jobgen validate``;
    read again here, on the node, where a changed file is a DataError naming the key)."""
    from jobgen.spec.data_files import PromptsFileError, read_prompts
    from trainer.data.formats import DataError

    prompts = list(spec.prompts)
    if spec.prompts_file:
        try:
            prompts += read_prompts(spec.prompts_file)
        except PromptsFileError as exc:
            raise DataError(f"eval.prompts_file: {exc}") from None
    return prompts
