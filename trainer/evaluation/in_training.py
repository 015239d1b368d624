"""What ``[eval]`` adds to the training loop: evaluations when due, the best checkpoint, and
early stopping.

The loop asks :meth:`RunEvaluation.wants_eval` at every step boundary (folded into its one
all-reduce, since ``every`` reads each rank's clock) and calls :meth:`evaluate` when any rank
said yes. An evaluation that beats the best is saved at once (``save_best``), so the best
checkpoint holds the very weights that were evaluated; ``checkpoints/best.json`` then names
it, and the checkpointer never prunes it (``keep_checkpoints`` keeps the newest N plus the
best).

The history of evaluations travels in every checkpoint, so everything here is derived from
it after a resume: the best, the evaluations since the best (early stopping's count) and the
best checkpoint. :meth:`sync_best` recomputes ``best.json`` at every start from the history
and the checkpoints on disk (rank 0 looks, every rank follows): a best checkpoint set aside as
broken, or a crash between a save and the write of ``best.json``, leaves it right again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jobgen.base.atomic import write_json_atomic
from jobgen.runs.rundir import RunDir, checkpoint_name, complete_checkpoints_in
from jobgen.runtime.records import MetricsWriter
from jobgen.runtime.stopping import Action, StopMonitor
from jobgen.spec.tables.eval import EvalSpec
from trainer.checkpoints.checkpointer import Checkpointer
from trainer.data.batches import DataPipeline, model_inputs_on
from trainer.data.formats import DataError
from trainer.distributed import DistEnv, broadcast_object
from trainer.evaluation.evaluator import EvalHistory, EvalResult, Evaluator, eval_prompts
from trainer.evaluation.samples import SampleGenerator
from trainer.parallel.step_parts import StepParts
from trainer.parallel.step_runner import StepRunner
from trainer.tracking import Trackers

log = logging.getLogger("trainer.eval")


class RunEvaluation:
    """The run's evaluations: schedule, records, the best checkpoint, early stopping."""

    def __init__(
        self,
        spec: EvalSpec,
        evaluator: Evaluator,
        env: DistEnv,
        run: RunDir,
        metrics: MetricsWriter,
        protect: Callable[[str | None], None],
        samples: SampleGenerator | None = None,
    ):
        """``protect(name)`` tells the checkpointer which checkpoint its pruning must keep;
        ``samples`` answers the prompts after each evaluation."""
        self.samples = samples
        self.spec = spec
        self.evaluator = evaluator
        self.env = env
        self.run = run
        self.metrics = metrics
        self.protect = protect
        self.history = EvalHistory(spec.min_delta)

    # ------------------------------------------------------------------ when

    def wants_eval(self, step: int) -> bool:
        return self.evaluator.wants_eval(step)

    def missed(self, step: int) -> bool:
        """At a job's start: the step resumed at was due for a periodic evaluation that a stop at
        its boundary left undone; doing it now keeps the evaluations those of an uninterrupted run."""
        every = self.spec.every_steps
        return every > 0 and step > 0 and step % every == 0 and self.history.last_step != step

    def due_at_end(self, step: int) -> bool:
        """At max_steps: the final evaluation (at_end, or a periodic one falling there), unless
        this step was evaluated already (a task resumed from the final checkpoint)."""
        periodic_here = self.spec.every_steps > 0 and step % self.spec.every_steps == 0
        return (self.spec.at_end or periodic_here) and self.history.last_step != step

    # ------------------------------------------------------------------ doing it

    def evaluate(self, step: int, trackers: Trackers) -> tuple[Action, bool]:
        """Evaluate now, then answer the prompts (collective). Returns (CONTINUE or a stop that
        came during the samples, whether it is the new best), or (the stop action, False) when
        a stop came during the evaluation itself: then nothing was recorded."""
        result, action = self.evaluator.run(step)
        if result is None:
            if self.env.is_main:
                log.warning("step %d: evaluation abandoned for a stop request", step)
            return action, False
        new_best = self.history.add(step, result.loss)
        self._record(result, new_best, trackers)
        if self.samples is None:
            return Action.CONTINUE, new_best
        records, action = self.samples.generate(step)
        if records is None:
            if self.env.is_main:
                log.warning("step %d: samples abandoned for a stop request", step)
        elif self.env.is_main:
            trackers.table(step, "samples", [(r["prompt"], r["completion"]) for r in records])
            first = records[0]
            log.info("sample at step %d: %r -> %r", step, first["prompt"][:80], first["completion"][:200])
        return action, new_best

    def _record(self, result: EvalResult, new_best: bool, trackers: Trackers) -> None:
        record = result.record()
        self.metrics.log_step(record)
        trackers.log(result.step, {"loss": result.loss, "ppl": result.perplexity}, section="eval")
        if self.env.is_main:
            best = self.history.best()
            assert best is not None
            log.info(
                "eval at step %d: loss %.4f ppl %.3f (%d target tokens, %d batches, %.1f s, %.0f target tokens/s)%s",
                result.step,
                result.loss,
                result.perplexity,
                result.target_tokens,
                result.batches,
                result.seconds,
                record["eval_target_tokens_per_s"],
                " new best" if new_best else f"; best {best[1]:.4f} at step {best[0]}",
            )

    def before_best_save(self, step: int) -> None:
        """The checkpoint about to be saved at ``step`` is the new best: pruning must keep it."""
        self.protect(checkpoint_name(step))

    def after_best_save(self, step: int) -> None:
        """Rank 0: ``best.json`` names the checkpoint just completed at ``step``."""
        best = self.history.best()
        if self.env.is_main and best is not None and best[0] == step:
            self._write_best(step, best[1])

    def _write_best(self, step: int, loss: float) -> None:
        write_json_atomic(
            self.run.best_checkpoint,
            {"step": step, "checkpoint": checkpoint_name(step), "eval_loss": loss, "time": time.time()},
        )

    # ------------------------------------------------------------------ early stopping

    def early_stop_reason(self) -> str | None:
        """Why the run stops early now (patience evaluations without improvement), or None."""
        if not self.spec.patience or self.history.since_best() < self.spec.patience:
            return None
        best = self.history.best()
        assert best is not None
        return f"early stop: no eval improvement since step {best[0]} (best eval loss {best[1]:.4f})"

    # ------------------------------------------------------------------ after a resume

    def sync_best(self) -> None:
        """Every rank: the best checkpoint from the history and the checkpoints on disk, as rank 0
        sees them; rank 0 rewrites ``best.json`` when it is missing or names another."""
        choice = None
        if self.env.is_main:
            saved = {step for step, _ in complete_checkpoints_in(self.run.checkpoints)}
            best = self.history.best()
            choice = best if best is not None and best[0] in saved else self.history.lowest_among(saved)
        choice = broadcast_object(self.env, choice)
        self.protect(checkpoint_name(choice[0]) if choice else None)
        if not self.env.is_main:
            return
        if choice is None:
            self.run.best_checkpoint.unlink(missing_ok=True)
            return
        current = self.run.best()
        if current is None or current.get("step") != choice[0]:
            log.info("best checkpoint: %s (eval loss %.4f)", checkpoint_name(choice[0]), choice[1])
            self._write_best(*choice)


def build_run_evaluation(
    spec: EvalSpec | None,
    data: DataPipeline,
    parts: StepParts,
    runner: StepRunner,
    *,
    monitor: StopMonitor,
    run: RunDir,
    metrics: MetricsWriter,
    checkpointer: Checkpointer,
) -> RunEvaluation | None:
    """The trainer's evaluations (None without ``[eval]``): over ``data``'s evaluation set, through
    ``parts``' model by ``runner``'s forward (the training loss path, or a pipeline's stages one
    after the other), stopped by ``monitor``; the prompts answered with ``data``'s tokenizer; the
    checkpointer told which checkpoint to keep."""
    if spec is None or data.eval_set is None:
        return None
    env = parts.env
    evaluator = Evaluator(
        parts.model,
        data.eval_set,
        env,
        monitor,
        runner.eval_loss_sum,
        model_inputs_on,
        every_steps=spec.every_steps,
        every_seconds=spec.every,
        scores=runner.scores_eval,
    )

    def protect(name: str | None) -> None:
        checkpointer.protected = name

    # Rank 0 reads prompts_file and every rank follows: under FSDP each prompt is a series of
    # collectives, so two ranks reading different files (NFS caches, an edit) would hang.
    outcome = broadcast_object(env, _read_prompts(spec) if env.is_main else None)
    assert isinstance(outcome, tuple)
    prompts, problem = outcome
    if problem:
        raise DataError(problem)
    samples = None
    if prompts:
        samples = SampleGenerator(
            parts.model,
            data.tokenizer,
            prompts,
            spec.max_new_tokens,
            env,
            monitor,
            run.samples,
            greedy_token=runner.greedy_token,
        )
    return RunEvaluation(spec, evaluator, env, run, metrics, protect, samples)


def _read_prompts(spec: EvalSpec) -> tuple[list[str], str | None]:
    """(the prompts, None), or ([], why not) for every rank to raise the same DataError."""
    try:
        return eval_prompts(spec), None
    except DataError as exc:
        return [], str(exc)
