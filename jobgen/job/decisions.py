"""What the supervisor decides, as functions of plain facts: how a launch ended, whether to
relaunch it and why not, whether a crash repeats. No file, clock or Slurm is read here: the
supervisor (:mod:`jobgen.job.supervisor`) gathers the facts once and acts on the answer, and
tests/unit/test_supervisor_decisions.py holds every rule to a row of
:data:`RELAUNCH_RULES` and of the launch-end cases (docs/supervisor.md is generated from them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from jobgen.base.exit_codes import ExitCode

# The words of a status that is no code of jobgen's: a launch killed, or a program of your own.
UNKNOWN_STATUS_WORDS = (
    "the program ended with status {status} and left no exit record (killed, or it died before writing one)"
)


def exit_words(status: int) -> str:
    """What an exit status means, in words for the job's comment and ``jobgen status``."""
    try:
        return ExitCode(status).reason
    except ValueError:
        return UNKNOWN_STATUS_WORDS.format(status=status)


def slurm_exit(status: int) -> int:
    """What the task exits with: 0 for a stop the run is built for (Slurm records COMPLETED, so
    ``--mail-type=FAIL`` and ``afterok`` mean what they say), else the status itself."""
    try:
        return 0 if ExitCode(status).planned else status
    except ValueError:
        return status


# ----------------------------------------------------------------------- a launch's end


@dataclass(frozen=True)
class ExitRecord:
    """The program's own exit record (RunDir.exit_code_file): its code and its reason."""

    code: int
    words: str


def parse_exit_record(text: str) -> ExitRecord | None:
    """The record as the program writes it (``CODE\\nWORDS\\n``); None when its first line is
    no number (a record being written, a damaged file): the launcher's status stands."""
    first, _, rest = text.partition("\n")
    if not first.strip().isdecimal():
        return None
    return ExitRecord(int(first.strip()), rest.split("\n", 1)[0])


@dataclass(frozen=True)
class Hang:
    """The hang watch ended the launch: the last step any rank took (None: unknown) and why."""

    step: int | None
    words: str


@dataclass(frozen=True)
class Failure:
    """A failure every later task would repeat: the run's failed marker holds it."""

    reason: str
    fix: str


@dataclass(frozen=True)
class LaunchFacts:
    """What is known when one launch of the program has ended."""

    launcher_status: int  # srun's (or, off Slurm, the node script's) exit status
    record: ExitRecord | None = None  # the program's exit record for this attempt, if it left one
    command_plan: bool = False  # your own program ([job] program = "command")
    forward_signal: str | None = None  # [command] stop_signal, when the lead-time signal is passed on
    forwarded: str | None = None  # what was forwarded ("USR1 118 s before the limit"), if it was
    caught: str | None = None  # the first signal the supervisor caught ("TERM", "USR1 118")
    seconds_left: int | None = None  # to the job's end as Slurm has it now (None: it cannot say)
    hang: Hang | None = None  # the hang watch's verdict, when it ended the launch
    last_hang_step: int | None = None  # the step of the previous launch's hang in this task
    ranks_started: bool = True  # a rank of this launch wrote its log (torchrun started the program)


@dataclass(frozen=True)
class LaunchEnd:
    """How a launch ended: the status the task reports, its words, and what follows."""

    status: int
    words: str = ""
    finished: bool = False  # your own program is done with its work: the done marker is written
    failed: Failure | None = None  # the run stops: the failed marker is written
    hang_step: int | None = None  # the step this launch hung at (compared with the next launch's)
    hung: bool = False

    @property
    def described(self) -> str:
        return self.words or exit_words(self.status)


FINISHED_WORDS = "finished: the program exited 0 on its own"
KILLED_AT_LIMIT_WORDS = "time limit: killed by Slurm (the program stopped without a jobgen save)"
KILLED_BY_TERM_WORDS = "SIGTERM (preemption, requeue or scancel): the program stopped without a jobgen save"
# A launch that ended this close to the job's end was killed by the time limit.
AT_THE_LIMIT_SECONDS = 5


def hang_fix(step: int | None) -> str:
    return (
        f"find what the stacks show the ranks waiting for at step {step} (a data or model problem hangs the "
        "same step again), then `jobgen submit` the run again"
    )


def launch_end(facts: LaunchFacts) -> LaunchEnd:
    """The launch's end, from the launcher's status and what the program and the watch left.

    torchrun exits 1 whatever went wrong in a worker: the program's own record (its code and
    reason for this attempt) is what the task reports. Your own program may leave none: then
    its end is read from the signals the supervisor sent or caught and from the clock."""
    status, words = facts.launcher_status, ""
    if facts.record is not None:
        status, words = facts.record.code, facts.record.words
    if not words and facts.forward_signal and facts.forwarded:
        # Stopped by the forwarded signal, as planned: the next task resumes from its own checkpoint.
        status = ExitCode.SIGNALLED
        words = (
            f"time limit (SIG{facts.forwarded}): SIG{facts.forward_signal} forwarded, "
            "the program stopped without a jobgen save"
        )
    end = LaunchEnd(int(status), words)
    if facts.command_plan:
        end = _own_program_end(end, facts)
    if facts.hang is not None:
        end = _hung(facts)
    elif facts.record is None and facts.launcher_status in UNRUNNABLE and not facts.ranks_started:
        end = _unrunnable(facts.launcher_status)
    return end


# The statuses of a command that never ran, whatever runs it: the container runtime's own failure
# (podman's and docker's 125: an image, a mount or an option it refused), a program that cannot be
# executed (126) or is not there (127). Read so only where no rank started: podman also exits 127
# when the container it waits for was removed under it (a node's step ended by another's failure).
# Then no relaunch and no later task gets further.
UNRUNNABLE = {
    125: "the container runtime could not start the step (an image, a mount or an option it refused)",
    126: "a command of the launch could not be executed",
    127: "a command of the launch was not found",
}
UNRUNNABLE_FIX = (
    "read the launch's error above 'program exited' in the batch log (jobgen logs RUN), correct the site's "
    "[python] or [env] (or the image), then `jobgen submit` the run again"
)


def _unrunnable(status: int) -> LaunchEnd:
    words = f"the launch never started the program (exit {status}): {UNRUNNABLE[status]}"
    return LaunchEnd(status, words, failed=Failure(words, UNRUNNABLE_FIX))


def _own_program_end(end: LaunchEnd, facts: LaunchFacts) -> LaunchEnd:
    if end.words:
        return end
    term = (facts.caught or "").startswith("TERM")
    if end.status == 0 and not term and not facts.forwarded:
        # Ended on its own with 0 and no signal sent to it: done with its work, so later tasks
        # exit at once instead of starting it over its last checkpoint. After a signal, 0 may be
        # a program's own clean stop: not finished.
        return replace(end, words=FINISHED_WORDS, finished=True)
    if end.status != 0:
        # Killed with no record of its own: by the time limit, or by SIGTERM (a preemption,
        # scancel): say so, not "crashed". Slurm's state (TIMEOUT, PREEMPTED) stays its own.
        if facts.seconds_left is not None and facts.seconds_left <= AT_THE_LIMIT_SECONDS:
            return replace(end, words=KILLED_AT_LIMIT_WORDS)
        if term:
            return replace(end, words=KILLED_BY_TERM_WORDS)
    return end


def _hung(facts: LaunchFacts) -> LaunchEnd:
    """The watch killed the launch: a hang, whatever the killed processes left. A relaunch may
    get past it; the same step as the previous launch's hang will not."""
    hang = facts.hang
    assert hang is not None
    end = LaunchEnd(int(ExitCode.HUNG), hang.words, hang_step=hang.step, hung=True)
    if hang.step is not None and hang.step == facts.last_hang_step:
        words = f"hung twice at step {hang.step}: {hang.words.removeprefix('hung: ')}"
        return replace(end, words=words, failed=Failure(words, hang_fix(hang.step)))
    return end


def checks_nodes(status: int, on_slurm: bool) -> bool:
    """Is a failed launch's set of nodes examined for one at fault (silent ranks, a node Slurm
    marked down)? Not for a planned stop, and not for a hang the watch ended: it proves no node bad."""
    if not on_slurm or status == ExitCode.HUNG:
        return False
    try:
        return not ExitCode(status).planned
    except ValueError:
        return True


def blamed(end: LaunchEnd, found: str) -> LaunchEnd:
    """The end of a launch whose nodes were at fault: a node failure, naming them."""
    if not found:
        return end
    return replace(end, status=int(ExitCode.NODE_FAILURE), words=f"node failure: {found}")


# ------------------------------------------------------------------- relaunch or not


@dataclass(frozen=True)
class RelaunchFacts:
    """What the relaunch decision weighs, gathered once after a launch ended."""

    status: int
    launches: int  # relaunches done inside this task so far
    in_job_restarts: int  # job.in_job_restarts
    relaunch_codes: frozenset[int]  # jobgen's codes a relaunch may get past
    stop_caught: str | None = None  # the first signal Slurm sent the task
    failed_marker: bool = False
    done_marker: bool = False
    kill_or_abort: bool = False  # a kill or abort switch is set
    seconds_left: int | None = None
    exit_grace: int = 0


@dataclass(frozen=True)
class RelaunchRule:
    """One reason not to relaunch: when it holds, and the words the batch log gives."""

    name: str
    holds: Callable[[RelaunchFacts], bool]
    words: Callable[[RelaunchFacts], str]


def _not_relaunchable(f: RelaunchFacts) -> bool:
    jobgen_codes = {int(code) for code in ExitCode}
    return f.status in jobgen_codes and f.status not in f.relaunch_codes


# In order: the first that holds is the reason given.
RELAUNCH_RULES: tuple[RelaunchRule, ...] = (
    RelaunchRule(
        "out of relaunches",
        lambda f: f.launches >= f.in_job_restarts,
        lambda f: f"it was relaunched {f.launches} time(s), job.in_job_restarts = {f.in_job_restarts}",
    ),
    RelaunchRule(
        "not a failure of the moment",
        _not_relaunchable,
        lambda f: f"exit {f.status} ({exit_words(f.status)}) is not a failure a relaunch can get past",
    ),
    RelaunchRule(
        "Slurm asked to stop",
        lambda f: f.stop_caught is not None,
        lambda f: f"Slurm asked the job to stop (SIG{f.stop_caught})",
    ),
    RelaunchRule("run failed", lambda f: f.failed_marker, lambda f: "the run is marked failed"),
    RelaunchRule("run finished", lambda f: f.done_marker, lambda f: "the run is finished"),
    RelaunchRule("kill or abort switch", lambda f: f.kill_or_abort, lambda f: "a kill or abort switch is set"),
    RelaunchRule(
        "time limit near",
        lambda f: f.seconds_left is not None and f.seconds_left <= f.exit_grace,
        lambda f: f"the time limit is {f.seconds_left} s away",
    ),
)


def relaunch_refusal(facts: RelaunchFacts, rules: tuple[RelaunchRule, ...] = RELAUNCH_RULES) -> str | None:
    """Why the launch that ended is not started again inside the task; None: relaunch it."""
    for rule in rules:
        if rule.holds(facts):
            return rule.words(facts)
    return None


# ---------------------------------------------------------- your own program's crashes

# What makes two error lines of one failure differ from run to run: addresses and object ids.
_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\bat \S+:\d+|\b(pid|PID)[ =:]\d+")
# An exception's last line, as Python's traceback prints it ("ValueError: ...", "torch.OutOfMemoryError").
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|Warning))\b(:.*)?$")


@dataclass(frozen=True)
class CrashSignature:
    """How your own program crashed: its exit status and the last error line it printed. The same
    signature in two launches (or two tasks) in a row is a failure every later one would meet."""

    status: int
    line: str = ""

    def describe(self) -> str:
        return f"exit {self.status}" + (f" ({self.line})" if self.line else "")


def error_line(lines: list[str]) -> str:
    """The line that says what went wrong, from the end of a rank's stderr: the last exception
    line, else the last non-empty line; addresses and pids masked so that a repeat compares equal."""
    kept = [line.strip() for line in lines if line.strip()]
    chosen = next((line for line in reversed(kept) if _EXCEPTION_LINE.match(line)), kept[-1] if kept else "")
    return _VOLATILE.sub("…", chosen)[:300]


@dataclass(frozen=True)
class CrashHistory:
    """The previous crash of the run's program (RunDir logs/command-crash.json), by whom."""

    signature: CrashSignature
    job_id: str
    array_job_id: str | None
    restart: int
    launch: int


@dataclass(frozen=True)
class Attempt:
    job_id: str
    array_job_id: str | None
    restart: int
    launch: int


def crash_repeats(previous: CrashHistory | None, now: CrashSignature, attempt: Attempt) -> bool:
    """Did the previous launch of this task, or the previous task of this submission, crash
    exactly so? A requeued job keeps its id: an earlier attempt of it does not count (what it
    met may have been the node's), nor does another submission of the run."""
    if previous is None or previous.signature != now:
        return False
    same_attempt = (previous.job_id, previous.restart) == (attempt.job_id, attempt.restart)
    earlier_launch = same_attempt and previous.launch < attempt.launch
    other_task = previous.job_id != attempt.job_id and (
        attempt.array_job_id is not None and previous.array_job_id == attempt.array_job_id
    )
    return earlier_launch or other_task


REPEATED_CRASH_FIX = (
    "find the cause in the program's log (jobgen logs RUN), change what it names, then `jobgen submit` the run again"
)


def own_crash(end: LaunchEnd, record_left: bool) -> bool:
    """Is this launch's end a crash of your own program that its signature should be kept for:
    a failure it reported no reason for (no exit record of its own), not a stop, a hang or a node?"""
    if record_left or end.words or end.hung:
        return False
    return slurm_exit(end.status) != 0


@dataclass
class LaunchHistory:
    """The launches of this task so far: their count, the restarts record, the last hang."""

    launches: int = 0
    restarts: list[dict] = field(default_factory=list)
    last_hang_step: int | None = None


# ------------------------------------------------------------------------ a lost node

# A rank of the launch has ended and the launch has not, this long after: its step may be waiting
# for a node that died (srun waits for every node's answer, which a dead one never gives, until
# Slurm declares it down after SlurmdTimeout: 300 s by default). Its nodes are asked then.
LOST_NODE_GRACE_SECONDS = 5
# A node whose slurmd did not answer this many checks in a row is lost.
NODE_MISSES_TO_LOSE = 2
# How often the watch looks at the launch (a directory listing), and checks the nodes once suspicious.
NODE_CHECK_SECONDS = 3
# How long the node watch takes to judge, from the first rank's end: its grace, then its checks
# and one more look. The hang watch waits that long (hang_waits_for_node_watch).
NODE_JUDGING_SECONDS = LOST_NODE_GRACE_SECONDS + (NODE_MISSES_TO_LOSE + 1) * NODE_CHECK_SECONDS


def suspect_lost_node(seconds_since_first_end: float | None) -> bool:
    return seconds_since_first_end is not None and seconds_since_first_end >= LOST_NODE_GRACE_SECONDS


def hang_waits_for_node_watch(seconds_since_first_end: float | None) -> bool:
    """A rank of the launch ended and the node watch is still judging: the silence the hang watch
    sees is that rank's end (a peer's connection closed under it), not a hang, and a hang's
    relaunch would go back to a node that may be dead. Found by the hour soak: a killed node was
    taken for a hang 10 s after its last step, and its stacks asked of the dead node for 34 s."""
    return seconds_since_first_end is not None and seconds_since_first_end < NODE_JUDGING_SECONDS


def node_misses(previous: dict[str, int], answered: dict[str, bool]) -> dict[str, int]:
    """Checks in a row each node did not answer: one answer clears its count."""
    return {node: 0 if ok else previous.get(node, 0) + 1 for node, ok in answered.items()}


def lost_nodes(misses: dict[str, int]) -> list[str]:
    return sorted(node for node, count in misses.items() if count >= NODE_MISSES_TO_LOSE)


# ------------------------------------------------------------------------ the array's end


def array_end_reason(*, done: bool, failed: bool, in_sweep: bool, task: str) -> str | None:
    """Why the array's pending tasks are cancelled as this task ends (None: they are not). A run
    finished or failed for good has nothing for them to do but take nodes from the queue only to
    exit. A sweep's array is the sweep's: one point's end leaves the other points' tasks alone."""
    if in_sweep:
        return None
    if done:
        return f"the run finished in task {task}"
    if failed:
        return f"the run stopped in task {task}: a failure every task would repeat (jobgen status)"
    return None
