"""The supervisor's decisions as a table: each row a case (the facts), the action and the reason.
tests/unit/test_supervisor_decisions.py runs every row against :mod:`jobgen.job.decisions` (and
removes each rule to see its row fail); docs/supervisor.md is generated from the same rows::

    python -m jobgen.job.decision_table --write docs/supervisor.md
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from jobgen.base.exit_codes import ExitCode
from jobgen.job.decisions import (
    FINISHED_WORDS,
    KILLED_AT_LIMIT_WORDS,
    KILLED_BY_TERM_WORDS,
    LOST_NODE_GRACE_SECONDS,
    NODE_JUDGING_SECONDS,
    NODE_MISSES_TO_LOSE,
    ExitRecord,
    Hang,
    LaunchFacts,
    RelaunchFacts,
)

RELAUNCH_CODES = frozenset({int(ExitCode.CRASHED), int(ExitCode.HUNG)})


def _relaunch(**changes) -> RelaunchFacts:
    """A crash with relaunches left, time left, nothing set: the relaunch goes ahead unless a change says no."""
    base = {"status": 1, "launches": 0, "in_job_restarts": 2, "relaunch_codes": RELAUNCH_CODES}
    return RelaunchFacts(**{**base, "seconds_left": 3600, "exit_grace": 120, **changes})


@dataclass(frozen=True)
class RelaunchCase:
    rule: str  # the RELAUNCH_RULES entry this row holds (None: no rule, the relaunch goes ahead)
    given: str
    facts: RelaunchFacts
    reason: str | None  # what the batch log says; None: relaunched


RELAUNCH_CASES: tuple[RelaunchCase, ...] = (
    RelaunchCase("", "a crash, relaunches and time left", _relaunch(), None),
    RelaunchCase("", "a hang the watch ended", _relaunch(status=int(ExitCode.HUNG)), None),
    RelaunchCase("", "a status of no jobgen code (a launch killed)", _relaunch(status=137), None),
    RelaunchCase(
        "out of relaunches",
        "the last relaunch crashed too",
        _relaunch(launches=2),
        "it was relaunched 2 time(s), job.in_job_restarts = 2",
    ),
    RelaunchCase(
        "not a failure of the moment",
        "the data cannot be used",
        _relaunch(status=int(ExitCode.DATA_ERROR)),
        "exit 18 (the data or the tokenizer cannot be used) is not a failure a relaunch can get past",
    ),
    RelaunchCase(
        "not a failure of the moment",
        "a node failure without spares",
        _relaunch(status=int(ExitCode.NODE_FAILURE)),
        "exit 20 (node failure: the node is quarantined and later tasks exclude it) is not a failure a relaunch "
        "can get past",
    ),
    RelaunchCase(
        "Slurm asked to stop",
        "SIGTERM came (preemption)",
        _relaunch(stop_caught="TERM"),
        "Slurm asked the job to stop (SIGTERM)",
    ),
    RelaunchCase("run failed", "the failed marker is there", _relaunch(failed_marker=True), "the run is marked failed"),
    RelaunchCase("run finished", "the done marker is there", _relaunch(done_marker=True), "the run is finished"),
    RelaunchCase(
        "kill or abort switch", "a switch is set", _relaunch(kill_or_abort=True), "a kill or abort switch is set"
    ),
    RelaunchCase(
        "time limit near", "the limit is within exit_grace", _relaunch(seconds_left=90), "the time limit is 90 s away"
    ),
)


@dataclass(frozen=True)
class EndCase:
    given: str
    facts: LaunchFacts
    status: int
    words: str
    action: str  # what follows: "", "done marker", "failed marker"


HUNG_WORDS = "hung: no rank took a step for 300 s after step 7 (train.hang_timeout); stacks in hangs/x.txt"

END_CASES: tuple[EndCase, ...] = (
    EndCase(
        "the trainer's record: a crash", LaunchFacts(1, ExitRecord(1, "crashed at step 3")), 1, "crashed at step 3", ""
    ),
    EndCase("the trainer's record: a planned stop", LaunchFacts(1, ExitRecord(13, "deadline")), 13, "deadline", ""),
    EndCase("no record, the launcher's status", LaunchFacts(137), 137, "", ""),
    EndCase("your program exited 0 on its own", LaunchFacts(0, command_plan=True), 0, FINISHED_WORDS, "done marker"),
    EndCase("your program exited 0 after SIGTERM", LaunchFacts(0, command_plan=True, caught="TERM"), 0, "", ""),
    EndCase(
        "your program killed at the time limit",
        LaunchFacts(143, command_plan=True, seconds_left=2),
        143,
        KILLED_AT_LIMIT_WORDS,
        "",
    ),
    EndCase(
        "your program killed by SIGTERM",
        LaunchFacts(143, command_plan=True, caught="TERM", seconds_left=600),
        143,
        KILLED_BY_TERM_WORDS,
        "",
    ),
    EndCase(
        "your program stopped by the forwarded signal",
        LaunchFacts(1, command_plan=True, forward_signal="TERM", forwarded="USR1 118 s before the limit"),
        int(ExitCode.SIGNALLED),
        "time limit (SIGUSR1 118 s before the limit): SIGTERM forwarded, the program stopped without a jobgen save",
        "",
    ),
    EndCase("the watch ended a hang", LaunchFacts(137, hang=Hang(7, HUNG_WORDS)), int(ExitCode.HUNG), HUNG_WORDS, ""),
    EndCase(
        "no record, no rank started, the container runtime's own failure (podman's 125: a mount it refused)",
        LaunchFacts(125, ranks_started=False),
        125,
        "the launch never started the program (exit 125): the container runtime could not start the step "
        "(an image, a mount or an option it refused)",
        "failed marker",
    ),
    EndCase(
        "no record, no rank started, a command not found (127)",
        LaunchFacts(127, command_plan=True, ranks_started=False),
        127,
        "the launch never started the program (exit 127): a command of the launch was not found",
        "failed marker",
    ),
    EndCase("a record of its own with 125", LaunchFacts(125, ExitRecord(125, "my own code")), 125, "my own code", ""),
    EndCase("127 after the ranks started (podman lost its container)", LaunchFacts(127), 127, "", ""),
    EndCase(
        "a hang at the previous launch's step",
        LaunchFacts(137, hang=Hang(7, HUNG_WORDS), last_hang_step=7),
        int(ExitCode.HUNG),
        "hung twice at step 7: no rank took a step for 300 s after step 7 (train.hang_timeout); stacks in hangs/x.txt",
        "failed marker",
    ),
)


def markdown() -> str:
    """docs/supervisor.md: the rows, as a person reads them."""
    out = [
        "# The job's supervisor: its decisions",
        "",
        "Generated by `python -m jobgen.job.decision_table --write docs/supervisor.md` from the rows",
        "tests/unit/test_supervisor_decisions.py runs against `jobgen/job/decisions.py`. The batch script",
        "hands the task to the supervisor (`exec python -m jobgen.job --settings JSON`) after its",
        "directives, environment and launch line; these are the decisions it takes from then on.",
        "",
        "## How a launch ended",
        "",
        "| given | status | reason | then |",
        "|---|---|---|---|",
    ]
    out += [f"| {c.given} | {c.status} | {c.words or '(the status in words)'} | {c.action or '-'} |" for c in END_CASES]
    out += [
        "",
        "Then, for a launch that did not stop as planned or hang, on Slurm: its nodes are examined",
        "(ranks that went silent, a node Slurm marked down); one at fault is quarantined and the end is a",
        f"node failure (exit {int(ExitCode.NODE_FAILURE)}). Your own program's crash with no reason of its own",
        "is compared with the launch or task before it (exit status and last error line): the same",
        "crash twice stops the run with the failed marker.",
        "",
        "## A node lost while a launch with spares runs (job.spare_nodes; jobgen/job/node_watch.py)",
        "",
        f"A rank of the launch left its end record and the launch has not ended {LOST_NODE_GRACE_SECONDS} s later: the",
        "launch's other nodes' slurmd are asked for a connection, a few seconds apart (nothing is asked while",
        f"the ranks train). One that does not answer {NODE_MISSES_TO_LOSE} checks in a row is lost: it is quarantined,",
        "the launch's step is killed (and srun, which waits for the dead node until Slurm declares it down",
        "after SlurmdTimeout), and the launch ends as a node failure, which a relaunch on the spares gets past.",
        f"Until the checks are done ({NODE_JUDGING_SECONDS} s after the first rank's end) the hang watch waits: the",
        "silence it would see is that rank's end, and a hang's relaunch would go back to the dead node.",
        "Without spares Slurm's own way stays: it finds the node after SlurmdTimeout, ends the job NODE_FAIL",
        "and requeues it onto healthy nodes.",
        "",
        "## Relaunch inside the task (job.in_job_restarts)",
        "",
        "The first rule that holds is the reason given; none holding, the program is relaunched.",
        "",
        "| rule | given | decision |",
        "|---|---|---|",
    ]
    out += [f"| {c.rule or '-'} | {c.given} | {c.reason or 'relaunch'} |" for c in RELAUNCH_CASES]
    out += [
        "",
        "## The task's end",
        "",
        "The task record and the job's comment say the reason; a planned stop (finished, a time limit,",
        "a preemption's save, the kill switch) exits 0, so Slurm records COMPLETED. Once the run is",
        "finished or failed, the array's pending tasks are cancelled, each with the reason as its comment.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobgen.job.decision_table", description=__doc__.split("\n")[0])
    parser.add_argument("--write", type=Path, help="write the page here (else print it)")
    args = parser.parse_args(argv)
    if args.write:
        args.write.write_text(markdown())
    else:
        sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
