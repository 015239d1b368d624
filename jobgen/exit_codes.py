"""Exit codes of the rendered job scripts and the programs they launch.

One table so the script, the trainer, the doctor and ``jobgen status`` agree on
what a number means. 0 means "nothing went wrong"; everything else names why.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    # The batch script refused to launch: allocation does not match the spec, the
    # head node cannot be named, a node has no address on the site's interface.
    LAUNCH_ERROR = 3
    # torchrun formed a world of the wrong size (nodes x procs_per_node).
    WORLD_SIZE_MISMATCH = 4
    # The node doctor ran but at least one rank reported a failed check.
    DOCTOR_FAILED = 5

    @property
    def reason(self) -> str:
        return _REASONS[self]


_REASONS = {
    ExitCode.OK: "ok",
    ExitCode.LAUNCH_ERROR: "launch error (see the batch log's 'jobgen:' lines)",
    ExitCode.WORLD_SIZE_MISMATCH: "world size differs from nodes x procs_per_node",
    ExitCode.DOCTOR_FAILED: "node doctor found failed checks",
}
