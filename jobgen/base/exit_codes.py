"""Exit codes of the rendered job scripts and the programs they launch.

One table so the script, the trainer, the doctor and ``jobgen status`` agree on
what a number means. 0 means "nothing went wrong"; everything else names why.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # also: the run reached max_steps (done marker written), or was already done
    CRASHED = 1  # an exception; the traceback is in the rank's log
    # The batch script refused to launch: allocation does not match the spec, the
    # head node cannot be named, a node has no address on the site's interface.
    LAUNCH_ERROR = 3
    # torchrun formed a world of the wrong size (nodes x procs_per_node).
    WORLD_SIZE_MISMATCH = 4
    # The node doctor ran but at least one rank reported a failed check.
    DOCTOR_FAILED = 5
    # The trainer's exits. Each one that saved left a complete checkpoint behind.
    KILL_SWITCH = 10  # switches/kill: saved, exited; queued array tasks exit at once
    ABORTED = 11  # switches/abort: exited at once, nothing saved
    SIGNALLED = 12  # SIGUSR1/SIGTERM, or the batch shell's stop request: saved, exited
    DEADLINE = 13  # the job's end time minus exit_grace was reached: saved, exited
    MEMORY_GUARD = 14  # host memory above / GPU free memory below the threshold: saved, exited
    NOT_STARTED = 15  # a kill or abort switch was present at start: nothing loaded
    RESUME_FAILED = 16  # checkpoints exist but none loads: refusing to start over silently
    # The checkpoint was written by a run with other data or another seed: its sample
    # order cannot be continued.
    RESUME_MISMATCH = 17
    DATA_ERROR = 18  # the data or the tokenizer cannot be used (file and key in the log)
    RUN_BUSY = 19  # another process holds the run directory's writer lease: nothing touched
    # A node of the task was at fault (silent ranks, Slurm marked it down): it is quarantined
    # and the run's pending tasks exclude it (jobgen.runs.quarantine).
    NODE_FAILURE = 20
    # Your own program is set up in a way jobgen's lifecycle cannot work with (e.g. a
    # Hugging Face Trainer whose output_dir is not the run's checkpoint directory, with
    # [command] hf_trainer): every task would repeat it.
    PROGRAM_SETUP = 21
    # The task's global batch (micro_batch_size x grad_accum x world size) differs from the
    # checkpoint's, with neither train.global_batch_size nor train.allow_batch_change.
    BATCH_CHANGED = 22
    # The model cannot be trained as [model] and [train] ask in this process: a malformed or
    # unsupported model, a loss head it lacks, a parallelism this world or device cannot run
    # (trainer.model.errors.ModelError and its kinds).
    MODEL_ERROR = 23
    # No rank took a step for train.hang_timeout (heartbeats, jobgen.runs.heartbeat): the
    # batch script took every rank's stacks and killed the launch (job.in_job_restarts).
    HUNG = 24

    @property
    def reason(self) -> str:
        return _REASONS[self]

    @property
    def planned(self) -> bool:
        """A stop the run was built for: finished, a time limit or its lead-time signal, a
        preemption's SIGTERM, the kill switch (each saved first), or a task that found the
        run stopped or finished and did not start. The batch script exits 0 for these, so
        Slurm records COMPLETED: ``--mail-type=FAIL`` and ``afterok`` mean what they say.
        Everything else (a crash, an abort, the memory guard, a failed start) ends FAILED
        with this code."""
        return self in _PLANNED

    @property
    def relaunches(self) -> bool:
        """May a relaunch inside the same task get past it (job.in_job_restarts)? A crash may
        be of the moment (a rank killed, a collective that timed out, a flaky device); every
        other code is a planned stop, a decision, or a failure the relaunch would meet again.
        A hang the batch script ended (no step for train.hang_timeout) may be of the moment too.
        A status that is no code of jobgen's (a launch killed before it wrote one) relaunches too."""
        return self in (ExitCode.CRASHED, ExitCode.HUNG)

    @property
    def repeats(self) -> bool:
        """Would the next array task fail the same way? Then the run stops (the trainer
        writes ``failed``) instead of letting every queued task allocate nodes, load and
        fail again."""
        return self in _FIXES

    @property
    def fix(self) -> str:
        """What the user has to change before the run can continue."""
        return _FIXES.get(self, "")


_REASONS = {
    ExitCode.OK: "ok",
    ExitCode.CRASHED: "crashed (see the traceback in the log)",
    ExitCode.LAUNCH_ERROR: "launch error (see the batch log's 'jobgen:' lines)",
    ExitCode.WORLD_SIZE_MISMATCH: "world size differs from nodes x procs_per_node",
    ExitCode.DOCTOR_FAILED: "node doctor found failed checks",
    ExitCode.KILL_SWITCH: "kill switch: saved and stopped",
    ExitCode.ABORTED: "abort switch: stopped without saving",
    ExitCode.SIGNALLED: "signal or stop request: saved and stopped",
    ExitCode.DEADLINE: "time limit near: saved and stopped",
    ExitCode.MEMORY_GUARD: "memory guard: saved and stopped",
    ExitCode.NOT_STARTED: "kill/abort switch present at start: did not start",
    ExitCode.RESUME_FAILED: "no checkpoint could be loaded",
    ExitCode.RESUME_MISMATCH: "the checkpoint belongs to other data or another seed",
    ExitCode.DATA_ERROR: "the data or the tokenizer cannot be used",
    ExitCode.RUN_BUSY: "another process is writing this run: did nothing",
    ExitCode.NODE_FAILURE: "node failure: the node is quarantined and later tasks exclude it",
    ExitCode.PROGRAM_SETUP: "the program's setup does not fit its run (see the reason)",
    ExitCode.BATCH_CHANGED: "the global batch differs from the checkpoint's",
    ExitCode.MODEL_ERROR: "the model cannot be trained as the spec asks",
    ExitCode.HUNG: "hung: no rank took a step for train.hang_timeout (stacks in hangs/)",
}

_PLANNED = frozenset({ExitCode.OK, ExitCode.KILL_SWITCH, ExitCode.SIGNALLED, ExitCode.DEADLINE, ExitCode.NOT_STARTED})


def signal_stop_words(signal_name: str, *, from_batch_shell: bool, lead_signal: str | None, lead_seconds: int) -> str:
    """Why a signal stopped the program, in words for ``jobgen status`` and the job's
    comment. ``from_batch_shell``: the batch shell caught it and left a stop request (Slurm's
    ``--signal=B:`` lead-time signal, or SIGTERM at preemption, requeue or scancel); else it
    reached the program itself (``scancel --signal=...``, or Slurm's SIGTERM to the step).
    ``lead_seconds``: how long before the job's end the lead-time signal came, as measured."""
    name = signal_name.upper().removeprefix("SIG")
    if from_batch_shell and lead_signal and name == lead_signal.upper().removeprefix("SIG"):
        return f"time limit ({name} {lead_seconds} s before the limit)"
    if name == "TERM":
        return "SIGTERM (preemption, requeue or scancel)"
    return f"SIG{name} ({'to the batch shell' if from_batch_shell else 'scancel --signal'})"


# The failures that every later task would repeat, with what to change. `jobgen submit`
# of the run clears the stop once it is fixed.
_FIXES = {
    ExitCode.WORLD_SIZE_MISMATCH: "make job.nodes and job.procs_per_node match what the site starts per node, "
    "then `jobgen submit` the run again",
    ExitCode.RESUME_FAILED: "no checkpoint of the run loads with this spec: restore [model]/[train] as they were "
    "when the checkpoints were written, or move checkpoints/ away to start over, "
    "then `jobgen submit` the run again",
    ExitCode.RESUME_MISMATCH: "put train.seed and the data back as they were for this run's checkpoints, or "
    "start a new run (another job.name), then `jobgen submit` again",
    ExitCode.DATA_ERROR: "fix the data or the tokenizer named in the reason, then `jobgen submit` the run again",
    ExitCode.PROGRAM_SETUP: "change what the reason names in [command] (for a Hugging Face Trainer: "
    "args = [..., '--output_dir', '{checkpoint_dir}']), then `jobgen submit` the run again",
    ExitCode.BATCH_CHANGED: "set train.global_batch_size to the checkpoint's global batch (grad_accum then follows "
    "the world size), or train.allow_batch_change = true, then `jobgen submit` the run again",
    ExitCode.MODEL_ERROR: "change what the reason names in [model] or [train] (or run on the site it needs), "
    "then `jobgen submit` the run again",
}
