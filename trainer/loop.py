"""The training loop: a Trainer whose whole state is ``state_dict()``-able.

Owns one job's training: the Trainer's state, one optimizer step, the loop and the
step-boundary decision. What the loop records (``metrics.jsonl``, ``tasks.jsonl``,
``metrics.json``) is trainer/job_record.py's; model, data, checkpoints, evaluation and stop
reasons live in their own rooms.

One optimizer step = ``grad_accum`` micro-batches per rank. The loss is the mean
over every target token of the step on every rank (token-weighted, so packing,
padding and uneven batches do not skew it), gradients are synchronised only on the
last micro-batch, then clipped, then the optimizer and the schedule step. At every
step boundary the ranks agree on one action (continue, save, or save-and-exit), carried in
the step's own all-reduce of the loss; a checkpointer decides when periodic saves are due.

Memory-lean options: with ``optimizer_in_backward`` each parameter is clipped and
stepped in its gradient hook during backward (trainer.optim.OptimizerInBackward), so
after backward there is nothing left to clip or step; ``loss_chunk_tokens`` computes
the loss inside the model's forward without the whole sequence's logits
(trainer.memory.chunked_loss); ``activation_offloading`` keeps the tensors saved for backward in host
memory during the micro-batch's forward and backward (trainer.memory.activation_offload).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.optim.lr_scheduler import LambdaLR

from jobgen.base.atomic import write_json_atomic
from jobgen.base.exit_codes import ExitCode
from jobgen.model.pipeline_split import NodeMemory
from jobgen.runs.rundir import RunDir, checkpoint_name
from jobgen.runtime.stopping import Action, StopMonitor
from jobgen.spec.global_batch import BatchShape, check_resume, shape_for
from jobgen.spec.resolved import ResolvedSpec
from trainer.checkpoints.checkpointer import Checkpointer
from trainer.checkpoints.snapshots import Snapshots
from trainer.data.batches import training_data
from trainer.data.packing import count_targets
from trainer.distributed import (
    DistEnv,
    mark_progress,
    pause_heartbeat,
    reduce_max,
    reduce_sum,
    reduce_sum_and_max,
    start_heartbeat,
    stop_heartbeat,
)
from trainer.evaluation.in_training import RunEvaluation, build_run_evaluation
from trainer.job_record import JobRecord
from trainer.memory.activation_offload import make_offloader
from trainer.memory.chunked_loss import loss_head_for
from trainer.metrics import StartupClock, ThroughputWindow
from trainer.model.build import trainable_parameters
from trainer.optim import OptimizerInBackward, build_optimizer, build_scheduler
from trainer.parallel.build import build_model
from trainer.parallel.step_parts import StepParts
from trainer.parallel.strategies import Strategy, context_parallel_for, strategy
from trainer.tracking import trackers_for_run

log = logging.getLogger("trainer")


class Boundary(NamedTuple):
    """What every rank does at a step boundary, agreed by all: the stop action, and whether a
    periodic save and an evaluation are due."""

    action: Action
    save_due: bool
    eval_due: bool


class Trainer:
    """One job's part of a run: resume, train to max_steps or a stop, and record what it did."""

    def __init__(
        self,
        spec: ResolvedSpec,
        run_dir: Path,
        env: DistEnv,
        monitor: StopMonitor,
        startup: StartupClock | None = None,
    ):
        """``startup``: the clock main() started when the process began (a new one if not given).
        The phases: the parallelism's checks, the data, the model, the optimizer, the checkpoint,
        the evaluation. The data comes before the model so that data that cannot be read is
        refused before a model is loaded."""
        assert spec.run.model is not None and spec.run.data is not None
        self.spec = spec
        self.cfg = spec.run.train
        self.run_dir = run_dir
        self.env = env
        self.monitor = monitor
        # This task's split of the global batch: grad_accum follows the world size when
        # train.global_batch_size is set (a resume on fewer nodes keeps the batch).
        self.batch = shape_for(self.cfg, env.world_size)
        self.startup = startup or StartupClock()
        # What this job records; its memory peaks' load phase starts here, before the data.
        self.record = JobRecord(run_dir, env, self.batch, self.startup)
        chosen = strategy(self.cfg.parallelism)
        chosen.check(self.cfg, env)  # before the data is read: it may refuse
        self.ranks_per_replica = self.cfg.ranks_per_replica(env.world_size)  # a pipeline's ranks share rows
        torch.manual_seed(self.cfg.seed)  # identical initialisation on every rank (FSDP2 does not broadcast)
        # The tokenizer and the tokenized data (from the cache, or built).
        self.data = training_data(spec, env, shard=chosen.data_shard(self.cfg, env))
        self.startup.mark("data")
        self.parts = self._build_model()
        self.runner = chosen.runner(self.parts)  # forward, backward and clipping of a step
        self.optimizer, self.scheduler = self._build_optimizer(chosen)
        self.checkpointer = self._checkpointer()
        self.snapshots = self._snapshots()
        # The end left a snapshot's writer running (Snapshots.close): the process group is not destroyed under it.
        self.snapshot_left_behind = False
        self.evaluation = self._build_evaluation()
        self.startup.mark("model")  # weights, wrapping, optimizer
        # Per-rank streams for dropout and friends; restored from checkpoints on resume.
        torch.manual_seed(self.cfg.seed * 1000 + env.rank)
        self.step = 0
        self.tokens_seen = 0  # non-padding tokens over all ranks
        self.target_tokens_seen = 0

    def _build_model(self) -> StepParts:
        """The model as the parallelism builds it, with what a step runs it through: the
        context-parallel group, the loss head and the activation offloader."""
        model_spec, data_spec, env = self.spec.run.model, self.spec.run.data, self.env
        assert model_spec is not None and data_spec is not None
        context = context_parallel_for(self.cfg, env)  # train.context_parallel's group, or None
        job = self.spec.run.job
        memory = job.node_memory()
        nodes = NodeMemory(self.spec.node_procs, memory) if memory else None
        model = build_model(model_spec, self.cfg, env, packing=data_spec.packing, context=context, nodes=nodes)
        target_only = self.cfg.target_logits_only and context is None  # shares keep every position
        return StepParts(
            model=model,
            env=env,
            train=self.cfg,
            pad_token_id=self.data.pad_token_id,
            context=context,
            loss_head=loss_head_for(model, self.cfg.loss_chunk_tokens, target_only),
            offloader=make_offloader(env.device, model_spec.activation_offloading),
        )

    def _build_optimizer(self, chosen: Strategy) -> tuple[torch.optim.Optimizer, LambdaLR]:
        """The optimizer of the trainable parameters (stepped in backward with
        train.optimizer_in_backward, its norm summed over the parallelism's group) and its schedule."""
        params = trainable_parameters(self.model)
        in_backward_group = chosen.norm_group(params) if self.cfg.optimizer_in_backward else None
        optimizer = build_optimizer(params, self.cfg, in_backward_group)
        return optimizer, build_scheduler(optimizer, self.cfg)

    def _build_evaluation(self) -> RunEvaluation | None:
        """[eval]: evaluations over the data's evaluation set, samples, the best checkpoint."""
        return build_run_evaluation(
            self.spec.run.eval,
            self.data,
            self.parts,
            self.runner,
            monitor=self.monitor,
            run=RunDir(self.run_dir),
            metrics=self.record.metrics,
            checkpointer=self.checkpointer,
        )

    @property
    def model(self) -> torch.nn.Module:
        """The model as the parallelism built it (the step parts' own)."""
        return self.parts.model

    def _checkpointer(self) -> Checkpointer:
        """Saves under <run>/checkpoints as train.save_every_steps, save_every and keep_checkpoints say."""
        return Checkpointer(
            self.run_dir / "checkpoints",
            self.env,
            keep=self.cfg.keep_checkpoints,
            every_steps=self.cfg.save_every_steps,
            every_seconds=self.cfg.save_every,
            async_save=self.cfg.async_save,
        )

    def _snapshots(self) -> Snapshots | None:
        """train.snapshot_every_steps where the batch script asked for them (a task that
        relaunches): on every rank or on none, since restoring one is collective."""
        if not self.cfg.snapshot_every_steps:
            return None
        snapshots = Snapshots.from_environment(self.env, self.cfg.snapshot_every_steps)
        (missing,) = reduce_max(self.env, [int(snapshots is None)])
        if missing or snapshots is None:
            return None
        snapshots.connect(self.cfg.collective_timeout)  # the copies on the next node
        return snapshots

    @property
    def checkpoint_optimizers(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        """What the checkpoint saves and loads: the optimizer, or with optimizer_in_backward the
        per-parameter optimizers (get_state_dict merges them into one state keyed by name)."""
        if isinstance(self.optimizer, OptimizerInBackward):
            return list(self.optimizer.optimizers.values())
        return self.optimizer

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "target_tokens_seen": self.target_tokens_seen,
            "sampler": self.data.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "seed": self.cfg.seed,
            "world_size": self.env.world_size,
            "batch": self.batch.to_json(),
            "saved_at": time.time(),
            "evals": self.evaluation.history.state_dict() if self.evaluation else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_resume(BatchShape.from_json(state.get("batch")), self.batch, self.cfg)
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.target_tokens_seen = int(state["target_tokens_seen"])
        self.data.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        if isinstance(self.optimizer, OptimizerInBackward):
            self.optimizer.set_lr(self.scheduler.get_last_lr()[0])
        if self.evaluation:
            self.evaluation.history.load_state_dict(state.get("evals"))

    def resume(self) -> Path | None:
        loaded = self._from_snapshot() or self.checkpointer.load_latest(self.model, self.checkpoint_optimizers)
        if loaded is not None:
            self.load_state_dict(loaded[0])
        if self.evaluation:  # the best checkpoint as the history and the disk now say
            self.evaluation.sync_best()
        return loaded[1] if loaded is not None else None

    def _from_snapshot(self) -> tuple[dict[str, Any], Path] | None:
        """A relaunch inside the task: the newest memory snapshot every rank holds, where it is
        newer than the newest checkpoint on disk (trainer.checkpoints.snapshots)."""
        if self.snapshots is None:
            return None
        step = self.snapshots.newest_common(self.checkpointer.newest_step())
        if step is None:
            return None
        state = self.snapshots.restore(step, self.model, self.checkpoint_optimizers)
        return (state, Path(f"snapshot-{checkpoint_name(step)}")) if state is not None else None

    def save(self, *, blocking: bool) -> Path:
        pause_heartbeat()  # the next step's mark of progress beats again
        return self.checkpointer.save(
            self.step, self.model, self.checkpoint_optimizers, self.state_dict(), blocking=blocking
        )

    # ------------------------------------------------------------------ one step

    def train_step(self) -> tuple[dict[str, float], Boundary]:
        """One optimizer step, and the ranks' decision for the boundary after it."""
        micro_batches = [self.data.next_batch() for _ in range(self.batch.grad_accum)]
        local_targets = sum(int(count_targets(b["labels"])) for b in micro_batches)
        local_tokens = sum(int(b["num_tokens"]) for b in micro_batches)
        local_padded = sum(int(b["input_ids"].numel()) for b in micro_batches)  # what the model computes on
        # Every rank of one replica (a pipeline's stages) holds the same rows: counted once.
        summed = reduce_sum(self.env, [float(local_targets), float(local_tokens), float(local_padded)])
        global_targets, global_tokens, global_padded = (x / self.ranks_per_replica for x in summed)
        # DDP and FSDP average gradients over the ranks (a pipeline's replicas); scaling by their
        # number turns that average into the sum, so the gradient is that of the global token mean.
        scale = self.cfg.gradient_ranks(self.env.world_size) / max(global_targets, 1.0)
        loss_sum = self.runner.forward_backward(micro_batches, scale)
        report = self.runner.step_report()  # the parallelism's own figures (expert load)
        grad_norm = self._clip_and_step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        # The last stage's loss under a pipeline, summed with the ranks' views of the boundary.
        (total_loss,), boundary = self.agree_after_step(float(loss_sum))
        self.tokens_seen += int(global_tokens)
        self.record.local_tokens += local_tokens
        self.target_tokens_seen += int(global_targets)
        return {
            "loss": total_loss / max(global_targets, 1.0),
            "grad_norm": grad_norm,
            "lr": lr,
            "step_tokens": int(global_tokens),
            "step_padded_tokens": int(global_padded),
            "step_target_tokens": int(global_targets),
            **report,
        }, boundary

    def _clip_and_step(self) -> float:
        """Clip, step, zero the gradients; returns the gradient norm before clipping. With
        optimizer_in_backward the hooks did all of it; the norm is the one they summed."""
        if isinstance(self.optimizer, OptimizerInBackward):
            self.optimizer.step()  # no work: it keeps the LR scheduler's bookkeeping as usual
            return self.optimizer.grad_norm()
        grad_norm = self.runner.clip(self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # ------------------------------------------------------------------ the loop

    def agree_after_step(self, loss_sum: float) -> tuple[list[float], Boundary]:
        """The step's loss summed over ranks, and what every rank does after the step that is
        ending (``self.step + 1``): the max of each rank's stop action and of its view of a
        periodic save and of an evaluation being due. All depend on rank-local things (switch
        files, signals, clocks); combined, every rank takes the same branch. One all-reduce
        for both: the boundary rides with the loss rather than costing a round trip of its own."""
        ending = self.step + 1
        eval_due = self.evaluation is not None and self.evaluation.wants_eval(ending)
        views = [
            (int(self.monitor.local_action()), max(Action)),
            (int(self.checkpointer.wants_save(ending)), 1),
            (int(eval_due), 1),
        ]
        (total,), (action, save_due, eval_due) = reduce_sum_and_max(self.env, [loss_sum], views)
        return [total], Boundary(Action(action), bool(save_due), bool(eval_due))

    def _evaluate(self) -> Action:
        """Evaluate now; a new best is saved at once and named in best.json. Returns the stop
        action that abandoned the evaluation, or CONTINUE."""
        assert self.evaluation is not None
        action, new_best = self.evaluation.evaluate(self.step, self.record.trackers)
        if new_best:
            self.evaluation.before_best_save(self.step)
            self.save(blocking=True)
            self.evaluation.after_best_save(self.step)
        return action

    def _evaluate_or_end(self) -> tuple[ExitCode, str] | None:
        """Evaluate; the exit code and reason when the run ends here (a stop during the
        evaluation, or early stopping), None to go on training."""
        assert self.evaluation is not None
        stop = self._evaluate()
        if stop.exits:
            return self._stop(stop)
        early = self.evaluation.early_stop_reason()
        if early:
            if self.env.is_main:
                log.warning("step %d: %s", self.step, early)
            return self._finish(early)
        return None

    def _finish(self, reason: str | None = None) -> tuple[ExitCode, str]:
        """The run is done (max_steps, or early stopping's ``reason``): the final evaluation when
        due, the final checkpoint, then the run's ``done`` marker. A stop request during that
        evaluation saves and exits instead, and the next task finishes."""
        if reason is None and self.evaluation is not None and self.evaluation.due_at_end(self.step):
            action = self._evaluate()
            if action.exits:
                return self._stop(action)
        reason = reason or f"reached step {self.step} of {self.cfg.max_steps}: finished"
        self.save(blocking=True)
        if self.env.is_main:
            write_json_atomic(
                self.run_dir / "done",
                {"step": self.step, "finished_at": time.time(), "tokens_seen": self.tokens_seen, "reason": reason},
            )
        return ExitCode.OK, reason

    def fit(self) -> tuple[ExitCode, str]:
        """Train until max_steps or a stop; returns the exit code and a one-line reason."""
        resumed = self.resume()
        mark_progress()
        # train.report_to, on rank 0, from the step this job starts at.
        trackers = trackers_for_run(self.spec, RunDir(self.run_dir), self.step, enabled=self.env.is_main)
        self.record.began(self.step, resumed.name if resumed else None, trackers)
        if self.env.is_main:
            log.info(
                "%s at step %d of %d (world size %d, global batch %d = %s, %s, seed %d)",
                f"resumed from {resumed.name}" if resumed else "starting",
                self.step,
                self.cfg.max_steps,
                self.env.world_size,
                self.batch.global_batch,
                self.batch.describe(),
                self.cfg.parallelism,
                self.cfg.seed,
            )
        self.model.train()
        try:
            if self.step >= self.cfg.max_steps:
                code, reason = self._finish()
                finished = f"already at step {self.step} of {self.cfg.max_steps}: finished"
                return code, finished if code is ExitCode.OK else reason
            return self._train_until_stop()
        finally:
            stop_heartbeat()
            self.checkpointer.close()
            if self.snapshots is not None:
                self.snapshot_left_behind = not self.snapshots.close()
            saves = {
                "save_seconds": self.checkpointer.save_seconds,
                "save_blocking_seconds": self.checkpointer.blocking_seconds,
            }
            if self.snapshots is not None:  # how long training waited for each snapshot's copy
                saves["snapshot_seconds"] = self.snapshots.seconds
            self.record.ended(self.step, saves, self.evaluation.evaluator.summary() if self.evaluation else {})

    def _train_until_stop(self) -> tuple[ExitCode, str]:
        """Step, record, and act on the ranks' step-boundary decision, until max_steps or a stop."""
        max_steps = self.cfg.max_steps
        window = ThroughputWindow()
        start_heartbeat(self.env)  # its first beat is the first step's end (jobgen.runs.heartbeat)
        if self.evaluation is not None and self.evaluation.missed(self.step):
            ended = self._evaluate_or_end()  # a stop came where this step's evaluation was due
            if ended:
                return ended
        while self.step < max_steps:
            step_metrics, boundary = self._timed_step()
            window.add(step_metrics["step_tokens"])
            if self.step % self.cfg.log_every_steps == 0 or self.step == max_steps:
                totals = {"tokens": self.tokens_seen, "target_tokens": self.target_tokens_seen, **self.data.drawn()}
                self.record.log_step(self.step, step_metrics, window, totals)
            if self.step >= max_steps:
                break
            action, save_due, eval_due = boundary
            if action.exits:
                return self._stop(action)
            if eval_due:
                ended = self._evaluate_or_end()
                if ended:
                    return ended
                window.reset()  # tokens/s are training's: the evaluation's time is not in them
            self._save_if_asked(action, save_due)
            if self.snapshots is not None and self.snapshots.due(self.step) and not save_due:
                self.snapshots.take(self.step, self.model, self.checkpoint_optimizers, self.state_dict())
            self.checkpointer.poll()
            mark_progress()
        return self._finish()

    def _timed_step(self) -> tuple[dict[str, float], Boundary]:
        """One optimizer step, with its wall time recorded and the step counter advanced."""
        step_started = time.time()
        step_metrics, boundary = self.train_step()
        self.step += 1
        self.record.step_taken(time.time() - step_started, self.step)
        mark_progress(self.step)
        return step_metrics, boundary

    def _stop(self, action: Action) -> tuple[ExitCode, str]:
        """Leave at this step boundary: save first unless aborting, then consume the stop request."""
        if self.env.is_main:
            log.warning("step %d: %s", self.step, self.monitor.describe(action))
        if action.saves:
            self.save(blocking=True)
            if self.env.is_main:
                self.monitor.consume_stop_request()
        return action.exit_code, self.monitor.describe(action)

    def _save_if_asked(self, action: Action, save_due: bool) -> None:
        """The save switch saves now and waits for the save; a periodic save that is due may
        finish in the background."""
        if action is Action.SAVE:
            if self.env.is_main:
                log.info("step %d: %s", self.step, self.monitor.describe(action))
            self.save(blocking=True)
            if self.env.is_main:
                self.monitor.consume_save_switch()
        elif save_due:
            self.save(blocking=False)

    def write_summary(self, code: ExitCode, reason: str) -> None:
        """``metrics.json`` and the ``exit`` line of ``tasks.jsonl`` (trainer/job_record.py), with
        what was trained on what. Collective: every rank calls it."""
        model_spec, data_spec = self.spec.run.model, self.spec.run.data
        run_facts = {
            "torch": torch.__version__,
            "model": model_spec.path if model_spec else None,
            "dataset": (data_spec.path or [path for _key, path in data_spec.paths()]) if data_spec else None,
            "data_stats": self.data.stats_dict(),
            "seed": self.cfg.seed,
            "parallelism": self.cfg.parallelism,
        }
        self.record.write_summary(int(code), reason, run_facts)
