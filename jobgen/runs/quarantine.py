"""Bad-node quarantine: the nodes a task of this run found at fault, kept off its later tasks.

Run by the batch script as a task ends in a failure (``py_on_head`` runs it in the job's
Python environment; it never imports torch)::

    python -m jobgen.runs.quarantine after-task --run-dir RUN --job 42 --restart 0 --nodes 'node[1-2]'

and by the start probe for the nodes that failed it::

    python -m jobgen.runs.quarantine probe-failed --run-dir RUN --job 42 --failed node2=WHY

and, where a task holds spare nodes (``job.spare_nodes``), before each launch for the nodes it
trains on::

    python -m jobgen.runs.quarantine launch-nodes --run-dir RUN --job 42 --count 2

A node is quarantined when

- a rank on it went silent: another rank of the task waited out a whole collective timeout
  (``train.collective_timeout``) and raised, while this rank never reached its exception
  handler (hung in a kernel, a GPU or a stuck file system, stopped, or killed). The
  trainer's ranks leave a :class:`RankEnd` as they fail; the rank map says which node runs
  which rank. A rank that crashed in Python (a bug that any node would repeat) reports,
  so its node is never blamed; when every node went silent, or none, nothing is decided;
- Slurm marks a node of the task's allocation DOWN, FAILing, DRAINing or NOT_RESPONDING
  (``slurm.NODE_UNUSABLE``) when the task ends; NOT_RESPONDING alone only when the node's
  slurmd does not answer a connection either (:func:`unusable_in`);
- the start probe (the batch script, before the launch) fails on it.

The nodes go into ``quarantine.json`` (``RunDir.quarantine``) with when, which task and why;
every pending job of the run gets them added to its excluded nodes (``scontrol update
ExcNodeList=``, with the spec's own ``job.exclude``), later submissions add them to
``--exclude``, ``jobgen status`` shows them, and ``jobgen doctor --clear RUN`` releases the
nodes its health check passes on.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from jobgen.base.atomic import write_json_atomic
from jobgen.base.safe_read import DamagedFile, as_int, is_finite, is_int, read_bytes, read_object
from jobgen.runs.rundir import RunDir
from jobgen.runs.sweep_files import SweepFileError
from jobgen.runs.sweep_runs import point_runs, slurm_view, sweep_of
from jobgen.slurm import client as slurm
from jobgen.spec.fields import SlurmName, StrictModel


@dataclass(frozen=True)
class Quarantined:
    node: str
    since: float  # epoch seconds
    job: str  # the task that found it at fault: ARRAYID_TASK where known, else the job id
    reason: str


class QuarantineError(ValueError):
    """``quarantine.json`` is no quarantine record: the message names the file and what is
    wrong. A ValueError, so callers that took a bad file as ``(OSError, ValueError)`` still do."""

    def __init__(self, path: Path, problem: str):
        self.path = path
        self.problem = problem
        super().__init__(f"{path} is not a quarantine record ({problem}); fix or delete it")


class _Entry(StrictModel):
    # allow_inf_nan=False: 1e400 parses as infinity, which no date can show.
    since: float = Field(allow_inf_nan=False)
    job: str
    reason: str


class _File(StrictModel):
    """The file's structure, checked once as it is read: every reader (status, submit's
    --exclude, doctor --clear, the batch script's merge) then works on checked entries.
    Node names are Slurm names: they go onto --exclude and ExcNodeList."""

    nodes: dict[SlurmName, _Entry]


def read(run: RunDir) -> dict[str, Quarantined]:
    """The quarantined nodes by name; an unreadable file is an error (:class:`QuarantineError`
    when it is no quarantine record), never an empty set: it would let a run back onto a node
    it had found broken."""
    try:
        text = read_bytes(run.quarantine)
    except FileNotFoundError:
        return {}
    except DamagedFile as exc:  # a link, a FIFO, a directory: no record either
        raise QuarantineError(run.quarantine, exc.problem) from None
    try:
        parsed = _File.model_validate_json(text)
    except ValidationError as exc:
        first, more = exc.errors()[0], len(exc.errors()) - 1
        where = ".".join(str(part) for part in first["loc"]) or "the file"
        message = str(first["msg"]).removeprefix("Value error, ")
        raise QuarantineError(run.quarantine, f"{where}: {message}" + (f", and {more} more" if more else "")) from None
    return {node: Quarantined(node=node, **entry.model_dump()) for node, entry in parsed.nodes.items()}


@contextmanager
def _locked(run: RunDir) -> Iterator[dict[str, Quarantined]]:
    """Read-modify-write under an exclusive lock: a batch script and a person's ``doctor
    --clear`` may change the file at the same time. Written to temp, fsynced, renamed."""
    lock_path = run.quarantine.with_name(run.quarantine.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        nodes = read(run)
        yield nodes
        data = {"nodes": {n: {k: v for k, v in asdict(q).items() if k != "node"} for n, q in sorted(nodes.items())}}
        write_json_atomic(run.quarantine, data)


def add(run: RunDir, nodes: dict[str, str], job: str) -> list[Quarantined]:
    """Quarantine ``nodes`` (node → reason) found at fault by ``job``; returns the new entries.
    A node already quarantined keeps its first entry."""
    added = []
    with _locked(run) as current:
        for node, reason in sorted(nodes.items()):
            if node not in current:
                current[node] = Quarantined(node, time.time(), job, reason)
                added.append(current[node])
    return added


def release(run: RunDir, nodes: list[str]) -> list[str]:
    """Take ``nodes`` out of quarantine; returns those that were in it."""
    with _locked(run) as current:
        return [n for n in nodes if current.pop(n, None) is not None]


def excluded_nodes(run: RunDir, spec_exclude: list[str]) -> list[str]:
    """What a job of the run must not run on: the spec's ``job.exclude`` and the quarantine,
    as Slurm hostlist items (``--exclude=`` / ``ExcNodeList=``)."""
    return [*spec_exclude, *sorted(n for n in read(run) if n not in spec_exclude)]


def exclude_from_pending(run: RunDir, spec) -> list[str]:
    """Give every pending job of the run (array tasks not started yet, chained submissions)
    the run's excluded nodes; returns the job ids updated. ``ExcNodeList`` replaces the list,
    so it always carries the spec's own exclusions too. A run with spares asks for no more nodes
    than are left (:func:`pending_node_count`); a ``job.min_nodes`` run asks for a node range, so
    a task starts on the nodes left."""
    # A sweep's point: the sweep's pending tasks may run any point, so they keep off every
    # node any of its points quarantined.
    name, _ = slurm_view(run, spec.run.job.name)
    sweep = sweep_of(run)
    runs = [run]
    if sweep is not None:
        try:
            runs = [point for _, point in point_runs(sweep) if point.exists()]
        except SweepFileError as exc:  # this point's own nodes are still kept off its next tasks
            print(f"jobgen: warning: {exc}: the pending tasks exclude this point's nodes only", file=sys.stderr)
    nodes = {n for r in runs for n in read(r)}
    exclude = ",".join([*spec.run.job.exclude, *sorted(n for n in nodes if n not in spec.run.job.exclude)])
    pending = [e for e in slurm.queue_named(name) if e.state in slurm.JOB_PENDING]
    fields = {"ExcNodeList": exclude}
    if pending and spec.run.job.spare_nodes:
        usable = usable_partition_nodes(spec.partition, spec.run.job.exclude, nodes)
        count = str(pending_node_count(spec.run.job.nodes, spec.run.job.spare_nodes, usable))
        # One task per node (--ntasks-per-node=1): Slurm 22.05 answers NumNodes alone with exit 0 and
        # keeps the count its NumTasks needs (measured on the dev cluster); the two together apply.
        fields |= {"NumNodes": count, "NumTasks": count}
    updated = []
    for entry in pending:
        job = entry.slurm_id
        slurm.update_job(job, **fields)
        updated.append(job)
    return updated


def pending_node_count(nodes: int, spares: int, usable: int) -> int:
    """The nodes a pending task of a run with spares asks for: job.nodes, and as many spares as
    the partition's usable nodes outside the run's exclusions hold. A task asking for more would
    wait for ever (a 3-node partition, 2 nodes and a spare, one node quarantined: found by the
    hour soak); it asks for every spare again once ``jobgen doctor --clear`` releases the nodes."""
    return max(nodes, min(nodes + spares, usable))


def usable_partition_nodes(partition: str | None, spec_exclude: list[str], quarantined: set[str]) -> int:
    """The partition's nodes (every node without one) that Slurm does not mark unusable and the
    run does not exclude."""
    excluded = set(quarantined)
    for item in spec_exclude:
        excluded.update(slurm.hostnames(item))
    count = 0
    for record in slurm.nodes():
        if partition and partition not in record.get("Partitions", "").split(","):
            continue
        if record.get("NodeName", "") in excluded or _marked_unusable(record):
            continue
        count += 1
    return count


# --------------------------------------------------------------------------- silent ranks


@dataclass(frozen=True)
class RankEnd:
    """What a trainer rank leaves as it fails (one small file per rank, only on failure):
    where it ran and how long it had been without progress (a step, a save, its start)
    when the error reached it. A rank that waited out a collective timeout waited at least
    that long; a rank that crashed in its own code did not."""

    rank: int
    node: str
    waited_seconds: float
    error: str  # the exception's type, for the log; never matched on
    # The signal the rank had caught before the error reached it (the job's teardown:
    # slurmstepd sends SIGCONT and SIGTERM to every process of the step), or None.
    signalled: str | None = None

    @property
    def on_its_own(self) -> bool:
        """The error reached the rank before anything told it to stop: it saw the failure
        itself (a rank woken by the teardown only learns that the others are gone)."""
        return self.signalled is None

    def write(self, run: RunDir, job_id: str, restart: int | str, launch: int = 0) -> None:
        path = run.rank_end(job_id, restart, self.rank, launch)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, asdict(self))


def record_rank_failure(
    run: RunDir, job_id: str, restart: int | str, rank: int, waited_seconds: float, exc: BaseException,
    signalled: str | None, launch: int = 0,
) -> None:  # fmt: skip
    """What a rank leaves as an error reaches it (the bundled trainer's ranks and a program's
    under jobgen.runtime alike). A write that fails is logged, never raised: the run
    directory itself may be what failed, and the error on its way out matters more."""
    node = os.environ.get("SLURMD_NODENAME") or "local"
    try:
        end = RankEnd(rank, node, round(waited_seconds, 1), type(exc).__name__, signalled)
        end.write(run, job_id, restart, launch)
    except OSError as write_error:
        logging.getLogger("jobgen").warning("could not record how rank %d ended: %s", rank, write_error)


def read_rank_ends(run: RunDir, job_id: str, restart: int | str, launch: int = 0) -> list[RankEnd]:
    """How the ranks of one launch of one attempt ended (a launch before it is not evidence)."""
    ends = []
    for path in sorted(run.rank_ends(job_id, restart, launch)):
        try:
            ends.append(_rank_end(read_object(path, "a rank's end") or {}))
        except (FileNotFoundError, ValueError, TypeError):  # DamagedFile is a ValueError
            continue  # a rank killed mid-write, or no such record: as good as silent
    return ends


def _rank_end(value: dict[str, Any]) -> RankEnd:
    """A RankEnd from its record, every field of its type (TypeError otherwise)."""
    end = RankEnd(**value)
    if not (is_int(end.rank) and isinstance(end.node, str) and is_finite(end.waited_seconds)):
        raise TypeError("not a rank's end")
    if not isinstance(end.error, str) or not isinstance(end.signalled, str | None):
        raise TypeError("not a rank's end")
    return end


def silent_nodes(rank_nodes: dict[int, str], ends: list[RankEnd], timeout_seconds: float) -> dict[str, str]:
    """The nodes with a rank that never reported on its own, when some rank reported waiting out the
    collective timeout (node → why). Nothing when no rank timed out (a crash, a kill: not a
    node's fault that can be told), and nothing when every node has a silent rank or none has."""
    timed_out = sorted(e.rank for e in ends if e.on_its_own and e.waited_seconds >= timeout_seconds)
    if not timed_out:
        return {}
    # A rank that stopped moving (a stopped process, one stuck in the kernel and woken by
    # the teardown's SIGCONT and SIGTERM) reports, if at all, only once it was signalled.
    reported = {e.rank for e in ends if e.on_its_own}
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(rank_nodes.items()):
        by_node.setdefault(node, []).append(rank)
    # One hung GPU leaves its node's other ranks timing out like everyone else's: a node
    # with any silent rank is at fault.
    silent = {node: [r for r in ranks if r not in reported] for node, ranks in by_node.items()}
    silent = {node: ranks for node, ranks in silent.items() if ranks}
    if not silent or len(silent) == len(by_node):
        return {}
    waited = f"{_ranks(timed_out)} waited out the {timeout_seconds:.0f} s collective timeout"
    return {node: f"its {_ranks(ranks)} went silent while {waited}" for node, ranks in silent.items()}


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def rank_nodes(run: RunDir, job_id: str, restart: int | str) -> dict[int, str]:
    """Global rank → node of one attempt (the trainer's rank map); empty when it never got
    that far."""
    try:
        raw = read_object(run.rank_map(job_id, restart), "a rank map") or {}
    except (FileNotFoundError, DamagedFile):
        return {}
    nodes = {as_int(rank): entry.get("node") if isinstance(entry, dict) else None for rank, entry in raw.items()}
    return {rank: node for rank, node in nodes.items() if rank is not None and isinstance(node, str)}


def _marked_unusable(record: dict[str, str]) -> bool:
    """Whether Slurm's record of a node (``scontrol show node``) has a state it cannot run jobs in."""
    return bool(set(record.get("State", "").split("+")) & slurm.NODE_UNUSABLE)


def unusable_nodes(nodes: list[str]) -> dict[str, str]:
    """Those of ``nodes`` that Slurm marks unusable now, with its state and reason (a node it
    only suspects counts when its slurmd does not answer us either: :func:`unusable_in`)."""
    port = functools.cache(slurm.slurmd_port)  # scontrol show config: only if a node is suspected, once

    def answers(record: dict[str, str]) -> bool:
        return slurm.slurmd_answers(slurm.slurmd_address(record, port()))

    return unusable_in(slurm.nodes(), nodes, answers)


def unusable_in(
    records: list[dict[str, str]], nodes: list[str], answers: Callable[[dict[str, str]], bool]
) -> dict[str, str]:
    """Those of ``nodes`` whose Slurm records (``scontrol show node``) say they cannot run jobs,
    with the state and reason. A node that is only NOT_RESPONDING (slurm.NODE_SUSPECTED: one
    message to its slurmd went unanswered, nothing worse) is asked itself (``answers``: does its
    slurmd accept a connection?) and counts as usable when it does: the hour soak saw Slurm mark
    a healthy node so for 20 s while its slurmd ended a killed launch's processes, and the task
    ended rather than relaunch on it."""
    found = {}
    for record in records:
        name, state = record.get("NodeName", ""), record.get("State", "")
        if name not in nodes or not _marked_unusable(record):
            continue
        only_suspected = set(state.split("+")) & slurm.NODE_UNUSABLE <= slurm.NODE_SUSPECTED
        if only_suspected and answers(record):
            continue
        why = record.get("Reason", "")
        found[name] = f"Slurm marked it {state}" + (f" ({why})" if why and why != "(null)" else "")
        if only_suspected:
            found[name] += " and its slurmd does not answer"
    return found


# --------------------------------------------------------------------------- entry point


def after_task(run: RunDir, job_id: str, restart: str, nodelist: str, launch: int = 0) -> list[Quarantined]:
    """A failed task (or one launch of its program inside it): quarantine its nodes at fault,
    keep the pending jobs off them."""
    spec = run.load_spec()
    nodes = slurm.hostnames(nodelist)
    found = unusable_nodes(nodes)
    ends = read_rank_ends(run, job_id, restart, launch)
    for node, why in silent_nodes(rank_nodes(run, job_id, restart), ends, spec.run.train.collective_timeout).items():
        found.setdefault(node, why)
    return _quarantine(run, spec, found, job_id)


class TooFewNodes(Exception):
    """Fewer usable nodes are left in the allocation than a launch trains on (job.spare_nodes)."""


def launch_nodes(run: RunDir, job_id: str, count: int) -> list[str]:
    """The ``count`` nodes the next launch inside a task with spares trains on: the allocation's
    nodes as Slurm has them now (with --no-kill a failed node leaves the job's NodeList, while
    SLURM_JOB_NODELIST keeps naming it), less those Slurm marks unusable and those this run
    quarantined, in the allocation's order; :class:`TooFewNodes` names each one left out."""
    records = slurm.show_job(int(job_id))
    allocation = slurm.hostnames(records[0].get("NodeList", "")) if records else []
    left_out = {node: f"quarantined ({q.reason})" for node, q in read(run).items() if node in allocation}
    for node, why in unusable_nodes(allocation).items():
        left_out.setdefault(node, why)
    usable = [node for node in allocation if node not in left_out]
    if len(usable) < count:
        held = f"the allocation holds {', '.join(allocation)}" if allocation else f"Slurm shows no job {job_id}"
        out = "".join(f"; {node} {why}" for node, why in sorted(left_out.items()))
        raise TooFewNodes(f"{len(usable)} usable node(s) left, the run trains on {count}: {held}{out}")
    return usable[:count]


def probe_failed(run: RunDir, job_id: str, failed: dict[str, str]) -> list[Quarantined]:
    spec = run.load_spec()
    return _quarantine(run, spec, {n: f"failed the start probe: {why}" for n, why in failed.items()}, job_id)


def lost(run: RunDir, job_id: str, found: dict[str, str]) -> list[Quarantined]:
    """Nodes the job's supervisor found lost while a launch ran (jobgen.job.node_watch), before Slurm did."""
    return _quarantine(run, run.load_spec(), found, job_id)


def _quarantine(run: RunDir, spec, found: dict[str, str], job_id: str) -> list[Quarantined]:
    if not found:
        return []
    task = _task_name(job_id)
    added = add(run, found, task)
    updated = exclude_from_pending(run, spec)
    for entry in added:
        print(f"jobgen: quarantined {entry.node}: {entry.reason}", file=sys.stderr)
    if updated:
        print(f"jobgen: pending job(s) {', '.join(updated)} now exclude {', '.join(found)}", file=sys.stderr)
    return [q for q in read(run).values() if q.node in found]


def _task_name(job_id: str) -> str:
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else job_id


def summary(entries: list[Quarantined]) -> str:
    return "; ".join(f"{q.node} quarantined ({q.reason})" for q in entries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobgen.runs.quarantine", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    after = sub.add_parser("after-task", help="a task failed: quarantine its nodes at fault")
    probe = sub.add_parser("probe-failed", help="the start probe failed on these nodes")
    for p in (after, probe):
        p.add_argument("--run-dir", type=Path, required=True)
        p.add_argument("--job", required=True, help="SLURM_JOB_ID")
    after.add_argument("--restart", default="0", help="SLURM_RESTART_COUNT")
    after.add_argument("--nodes", required=True, help="SLURM_JOB_NODELIST")
    after.add_argument("--launch", type=int, default=0, help="JOBGEN_LAUNCH: the program's launch inside the task")
    probe.add_argument("--failed", action="append", default=[], metavar="NODE=WHY", help="a node and what failed")
    choose = sub.add_parser("launch-nodes", help="the nodes the next launch trains on (job.spare_nodes)")
    choose.add_argument("--run-dir", type=Path, required=True)
    choose.add_argument("--job", required=True, help="SLURM_JOB_ID")
    choose.add_argument("--count", type=int, required=True, help="job.nodes")
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir.absolute())
    if args.command == "launch-nodes":
        # stdout: the nodes, comma-separated (srun --nodelist); stderr and exit 1: why there are too few.
        try:
            print(",".join(launch_nodes(run, args.job, args.count)))
        except (TooFewNodes, QuarantineError) as exc:
            print(f"jobgen: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "after-task":
        entries = after_task(run, args.job, args.restart, args.nodes, args.launch)
    else:
        failed = dict(item.split("=", 1) if "=" in item else (item, "no answer") for item in args.failed)
        entries = probe_failed(run, args.job, failed)
    # stdout: the words for the job's comment and status, empty when no node was at fault.
    print(summary(entries))
    return 0


def to_json(entries: dict[str, Quarantined]) -> list[dict[str, Any]]:
    return [asdict(q) for q in sorted(entries.values(), key=lambda q: q.node)]


if __name__ == "__main__":
    sys.exit(main())
