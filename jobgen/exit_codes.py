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

    @property
    def reason(self) -> str:
        return _REASONS[self]


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
}
