"""When to stop: switch files, signals, the job's deadline, memory pressure.

Signal handlers only set a flag. Once per optimizer step every rank reports what it
sees, one small all-reduce (max) combines the reports, and every rank takes the
same branch on the same step, so no rank is left waiting in a collective for a
rank that decided to leave.

Switch files live in ``<run_dir>/switches/`` and anyone who can write the run
directory can create them (``jobgen stop RUN`` or plain ``touch``):

- ``kill``  save a checkpoint and exit; also makes queued array tasks exit at once
- ``save``  save a checkpoint, delete the file, continue
- ``abort`` exit at once without saving
- ``stop.<jobid>.<restart>`` written by the batch shell when Slurm's lead-time signal
  (or SIGTERM) arrives. A requeued job keeps its id, so the restart count is in the
  name: a request an earlier attempt never consumed (SIGKILL after KillWait) cannot
  stop a later attempt, and the batch script deletes such leftovers before it starts.

This module owns when to stop; the switch files' names are the run directory's layout
(jobgen.runs.rundir: ``*_SWITCH``, ``RunDir.stop_request``). It imports no torch: the bundled
trainer (``Trainer.agree_after_step``) and a user's own program (:mod:`jobgen.runtime`) use
this one implementation, each combining the ranks' actions with its own all-reduce, and
the trainer supplies the GPU's free memory (``StopSettings.gpu_free_bytes``).
"""

from __future__ import annotations

import enum
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from jobgen.base.exit_codes import ExitCode, signal_stop_words
from jobgen.runs.rundir import ABORT_SWITCH, KILL_SWITCH, SAVE_SWITCH, switch_is_set
from jobgen.slurm import client as slurm


class Action(enum.IntEnum):
    """Ordered by precedence: the largest wins when ranks (or causes) disagree."""

    CONTINUE = 0
    SAVE = 1  # save and continue
    MEMORY = 2
    DEADLINE = 3
    SIGNAL = 4
    KILL = 5
    ABORT = 6

    @property
    def saves(self) -> bool:
        return self in (Action.SAVE, Action.MEMORY, Action.DEADLINE, Action.SIGNAL, Action.KILL)

    @property
    def exits(self) -> bool:
        return self not in (Action.CONTINUE, Action.SAVE)

    @property
    def exit_code(self) -> ExitCode:
        return {
            Action.MEMORY: ExitCode.MEMORY_GUARD,
            Action.DEADLINE: ExitCode.DEADLINE,
            Action.SIGNAL: ExitCode.SIGNALLED,
            Action.KILL: ExitCode.KILL_SWITCH,
            Action.ABORT: ExitCode.ABORTED,
        }.get(self, ExitCode.OK)


@dataclass
class StopSettings:
    switches: Path
    stop_request: Path | None  # this attempt's stop request (jobgen.runs.rundir.RunDir.stop_request)
    deadline: float | None  # epoch seconds after which we must save and leave
    max_host_memory_percent: float
    min_gpu_free_mib: int
    # Only one rank looks at the switch files: thousands of ranks stat-ing a shared
    # filesystem every step is a metadata storm; the all-reduce spreads the answer.
    check_files: bool = True
    # Slurm's lead-time signal (site slurm.signal) and job.exit_grace: to say "time limit"
    # when the stop request came from that signal.
    lead_signal: str | None = None
    exit_grace: int = 0
    # The GPU's free memory in bytes, for min_gpu_free_mib (None: no GPU, or not measured).
    gpu_free_bytes: Callable[[], int] | None = None


def job_end_time(job_id: str | None, environ: Mapping[str, str] | None = None) -> float | None:
    """The job's scheduled end (epoch seconds), or None when there is no limit to honour.

    ``JOBGEN_JOB_END_TIME`` (epoch seconds) wins: it lets runs outside Slurm (``--local``,
    another scheduler) have a deadline. Then ``SLURM_JOB_END_TIME`` (Slurm 23.02+), then
    ``squeue``'s end time for the job (Slurm 22.05 sets no variable for it).
    """
    environ = os.environ if environ is None else environ
    for variable in ("JOBGEN_JOB_END_TIME", "SLURM_JOB_END_TIME"):
        value = environ.get(variable, "")
        if value.isdigit():
            return float(value)
    if not job_id or not job_id.isdigit():
        return None
    return slurm.end_time(job_id)


# The first signal a StopMonitor of this process caught. A rank's end report carries it
# (jobgen.runs.quarantine): a rank whose error came only after the job's teardown signalled it
# had not been waiting in the collective that timed out elsewhere.
_first_signal: list[str] = []


def first_signal_caught() -> str | None:
    return _first_signal[0] if _first_signal else None


class StopMonitor:
    """Collects this rank's reasons to stop; ``Trainer.agree_after_step`` combines them over all ranks."""

    HANDLED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)

    def __init__(self, settings: StopSettings):
        self.settings = settings
        self.signal_received: int | None = None
        # What the batch shell wrote into the stop request: the signal it caught, and when.
        self.requested_by: str | None = None
        self.requested_at: float | None = None
        self._previous = {}

    def install_signal_handlers(self) -> None:
        for signum in self.HANDLED:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        # Only a flag: the loop acts on it at the next step boundary.
        self.signal_received = signum
        if not _first_signal:
            _first_signal.append(signal.Signals(signum).name)

    def local_action(self, now: float | None = None) -> Action:
        now = time.time() if now is None else now
        s = self.settings
        found = Action.CONTINUE
        if s.check_files and switch_is_set(s.switches / ABORT_SWITCH):
            return Action.ABORT
        if s.check_files and switch_is_set(s.switches / KILL_SWITCH):
            found = max(found, Action.KILL)
        stop_file = s.check_files and s.stop_request is not None and switch_is_set(s.stop_request)
        if stop_file and self.requested_by is None:
            self.requested_by, self.requested_at = _read_request(s.stop_request)
        if self.signal_received is not None or stop_file:
            found = max(found, Action.SIGNAL)
        if s.deadline is not None and now >= s.deadline:
            found = max(found, Action.DEADLINE)
        if psutil.virtual_memory().percent > s.max_host_memory_percent:
            found = max(found, Action.MEMORY)
        gpu_low = s.min_gpu_free_mib and s.gpu_free_bytes is not None
        if gpu_low and s.gpu_free_bytes() < s.min_gpu_free_mib * 1024 * 1024:
            found = max(found, Action.MEMORY)
        if s.check_files and switch_is_set(s.switches / SAVE_SWITCH):
            found = max(found, Action.SAVE)
        return found

    def describe(self, action: Action) -> str:
        s = self.settings
        if action is Action.SIGNAL:
            return f"{self._signal_words()}: saving and exiting"
        return {
            Action.ABORT: f"abort switch {s.switches / ABORT_SWITCH}: exiting without saving",
            Action.KILL: f"kill switch {s.switches / KILL_SWITCH}: saving and exiting",
            Action.DEADLINE: (
                f"time limit near (deadline: the job's end minus exit_grace, {s.exit_grace} s): saving and exiting"
            ),
            Action.MEMORY: "memory guard: saving and exiting so the next job starts with clean memory",
            Action.SAVE: f"save switch {s.switches / SAVE_SWITCH}: saving and continuing",
        }.get(action, "continuing")

    def _signal_words(self) -> str:
        s = self.settings
        if self.requested_by:
            return signal_stop_words(
                self.requested_by, from_batch_shell=True, lead_signal=s.lead_signal, lead_seconds=self._lead()
            )
        if self.signal_received:
            return signal_stop_words(
                signal.Signals(self.signal_received).name,
                from_batch_shell=False,
                lead_signal=s.lead_signal,
                lead_seconds=s.exit_grace,
            )
        return f"stop request {s.stop_request.name if s.stop_request else ''}".strip()

    def _lead(self) -> int:
        """How long before the job's end the request came: Slurm sends its lead-time signal up
        to a minute earlier than asked. exit_grace when the request or the end is unknown."""
        s = self.settings
        if self.requested_at is None or s.deadline is None:
            return s.exit_grace
        return max(0, round(s.deadline + s.exit_grace - self.requested_at))

    def consume_save_switch(self) -> None:
        try:
            os.unlink(self.settings.switches / SAVE_SWITCH)
        except FileNotFoundError:
            pass

    def consume_stop_request(self) -> None:
        if self.settings.stop_request is not None:
            try:
                os.unlink(self.settings.stop_request)
            except FileNotFoundError:
                pass


def _read_request(path: Path) -> tuple[str, float | None]:
    """The signal named in a stop request and the epoch second the batch shell caught it
    ("" and None for a request written by hand; no time from a jobgen before requests had one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a link planted after the check is not read
    except OSError:
        return "", None
    with os.fdopen(fd, "rb") as fh:
        words = fh.read(64).decode(errors="replace").split()
    name = words[0][:16] if words else ""
    at = words[1] if len(words) > 1 else ""
    return name, float(at) if at.isdigit() else None


def startup_switch(switches: Path) -> Action:
    """A kill or abort switch present before anything is loaded."""
    if switch_is_set(switches / ABORT_SWITCH):
        return Action.ABORT
    if switch_is_set(switches / KILL_SWITCH):
        return Action.KILL
    return Action.CONTINUE
