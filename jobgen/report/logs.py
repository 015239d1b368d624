"""``jobgen logs``: a run's logs merged into one stream, each line prefixed with where it
came from, filtered by task, node, rank and pattern, and followed while the job runs.

Where lines come from (names from :class:`jobgen.runs.rundir.RunDir`):

- the batch log of each job (and each node's launch log, where the site asks for one):
  jobgen's own lines, srun's and torchrun's. Ranks' lines reach it too (torchrun
  ``--tee``), prefixed ``[default0]:``; those are taken from the ranks' own files instead,
  where they carry the node and the rank;
- each rank's ``stdout.log``/``stderr.log`` under ``logs/ranks/<job>/<node>/``, one
  directory per launch of torchrun (a requeued job launches again under the same id).
  The global rank comes from ``ranks.<restart>.json``, which the trainer's rank 0 writes
  at start (``RunDir.rank_map``); else from the rank's own record next to its node's logs
  (``RunDir.rank_identity``, for a program that writes no rank map); else from its lines
  (``trainer[3]``); else, in a one-node job, it is the local rank. Without any of these
  torchrun's logs do not say it (the rendezvous orders the nodes by address and process id,
  not by name), and the node and local rank are shown: ``node2 local0``.

A line is prefixed ``ARRAYID_TASK node rRANK |``. Without ``--follow`` the lines of all
sources are merged by their timestamps (a line without one keeps its predecessor's);
with it, new lines are printed as they arrive, and new sources (the next task, a rank
directory created late) are picked up while following.
"""

from __future__ import annotations

import datetime as dt
import heapq
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jobgen.base.safe_read import DamagedFile, as_int, is_int, lines_backwards, open_regular, read_object
from jobgen.base.visible import visible
from jobgen.report.task_table import read_task_records
from jobgen.runs.jsonl_records import read_tasks
from jobgen.runs.rundir import RunDir

# torchrun's --tee prefix on the ranks' lines in the batch log: "[default0]:".
_TEED = re.compile(r"^\[[A-Za-z_]+\d+\]:")
# The timestamps of jobgen's, the trainer's and torchrun's lines ...
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d)")
# ... and of c10d's (glog: "[W1122 11:33:54.790578628 socket.cpp:207]", no year).
_GLOG = re.compile(r"^\[?[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d)")
# ... and of Python's logging as the Hugging Face example scripts set it up ("11/22/2026 10:00:09").
_US_STAMP = re.compile(r"(\d\d)/(\d\d)/(\d{4}) (\d\d:\d\d:\d\d)")
# The trainer's line prefix names the global rank: "trainer[3]".
_TRAINER_RANK = re.compile(rb"trainer\[(\d+)\]")


@dataclass(frozen=True)
class Filters:
    task: str | None = None  # "3" (array task index), "5_3" (Slurm's name) or a job id
    node: str | None = None
    rank: int | None = None
    grep: re.Pattern[str] | None = None


@dataclass
class Source:
    path: Path
    job_id: str
    name: str  # ARRAYID_TASK, or the job id
    node: str | None = None
    rank: int | None = None  # global rank when known
    local_rank: int | None = None
    batch: bool = False  # a batch or node launch log: the ranks' teed lines are skipped there
    found_at: float = field(default_factory=time.time, compare=False)
    offset: int = field(default=0, compare=False)
    partial: str = field(default="", compare=False)

    @property
    def prefix(self) -> str:
        where = [self.name]
        if self.node:
            where.append(self.node)
        if self.rank is not None:
            where.append(f"r{self.rank}")
        elif self.local_rank is not None:
            where.append(f"local{self.local_rank}")
        # Task and node names come from records and directory names: made visible. The lines
        # after the prefix are the program's own output, shown as it wrote them.
        return visible(" ".join(where))


def _slurm_names(run: RunDir) -> dict[str, str]:
    """job id -> ARRAYID_TASK, from the records of the batch script and the trainer (each
    read by its typed reader: a record that is none is left out). A task outside an array (a
    ``--local`` run's: task 1, no array id) is JOBID_1, as ``jobgen status`` names it."""
    names: dict[str, str] = {}
    records = [*read_task_records(run).values(), *read_tasks(run.path / "tasks.jsonl")]
    for record in records:
        job, array, index = record.get("job_id"), record.get("array_job_id"), record.get("array_task")
        if job and as_int(index) is not None:
            names[str(job)] = f"{array or job}_{index}"
    return names


def _rank_maps(run: RunDir, job_id: str) -> dict[int, dict[tuple[str, int], int]]:
    """restart -> {(node, local rank): global rank} from the trainer's rank maps; a map that
    is none (cut, edited, a link) is left out, and its ranks are named another way."""
    out = {}
    for path in run.rank_maps(job_id):
        try:
            restart = int(path.name.split(".")[1])
            value = read_object(path, "a rank map") or {}
            ranks = {(v["node"], v["local_rank"]): as_int(r) for r, v in value.items()}
        except (FileNotFoundError, ValueError, KeyError, IndexError, TypeError):  # DamagedFile is a ValueError
            continue
        if all(isinstance(node, str) and is_int(local) and rank is not None for (node, local), rank in ranks.items()):
            out[restart] = ranks
    return out


def find_sources(run: RunDir, job_name: str, filters: Filters) -> list[Source]:
    """Every log of the run that the filters let through, in job order."""
    names = _slurm_names(run)
    # The logs directory listed once (a run of 500 tasks holds 1000 files): each job's batch log
    # (NAME-JOB.out) and its nodes' launch logs (NAME-JOB-NODE.out; a job id has no "-").
    by_job: dict[str, list[tuple[str | None, Path]]] = {}
    for path in sorted(run.logs.glob("*.out")):
        job, _, node = path.name.removeprefix(f"{job_name}-").removesuffix(".out").partition("-")
        by_job.setdefault(job, []).append((node or None, path))
    ranks = {p.name for p in (run.logs / "ranks").glob("*") if p.is_dir()}
    out = []
    for job in sorted(by_job.keys() | ranks, key=lambda j: (len(j), j)):
        name = names.get(job, job)
        if filters.task and filters.task not in (job, name, name.partition("_")[2]):
            continue
        if filters.rank is None:
            out += _batch_sources(by_job.get(job, []), job, name, filters)
        out += _rank_sources(run, job, name, filters)
    return out


def _batch_sources(logs: list[tuple[str | None, Path]], job: str, name: str, filters: Filters) -> list[Source]:
    """A job's batch log and its nodes' launch logs: ``logs``, (node or None, path), its files."""
    out = []
    for node, path in sorted(logs, key=lambda pair: (pair[0] is not None, pair[1].name)):
        if node is None and filters.node is None and path.is_file():
            out.append(Source(path, job, name, batch=True))
        elif node is not None and filters.node in (None, node):
            out.append(Source(path, job, name, node=node, batch=True))
    return out


def _rank_sources(run: RunDir, job: str, name: str, filters: Filters) -> list[Source]:
    """Each rank's stdout and stderr of a job, on every node and in every launch (restart)."""
    maps = _rank_maps(run, job)
    one_node = _one_node(run, job)
    out = []
    for node_dir in sorted(p for p in (run.logs / "ranks" / job).glob("*") if p.is_dir()):
        if filters.node not in (None, node_dir.name):
            continue
        launches = sorted((p for p in node_dir.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        for restart, launch in enumerate(launches):
            for log in sorted(launch.glob("attempt_*/*/std*.log")):
                local = int(log.parent.name) if log.parent.name.isdigit() else None
                rank = maps.get(restart, {}).get((node_dir.name, local)) if local is not None else None
                if rank is None and restart not in maps and local is not None:
                    rank = _rank_of(run, job, node_dir.name, restart, local, log, one_node)
                if filters.rank is not None and rank != filters.rank:
                    continue
                out.append(Source(log, job, name, node=node_dir.name, rank=rank, local_rank=local))
    return out


def _rank_of(run: RunDir, job: str, node: str, restart: int, local: int, log: Path, one_node: bool) -> int | None:
    """A rank's global rank without a rank map: its own record, its lines, or in a one-node
    job its local rank (the only node is group rank 0)."""
    try:
        value = read_object(run.rank_identity(job, node, restart, local), "a rank's record")
        if value is not None and is_int(value.get("rank")):
            return value["rank"]
    except DamagedFile:
        pass  # as good as none: the rank is found from its lines
    rank = _rank_in_file(log.with_name("stdout.log"))
    return local if rank is None and one_node else rank


def _one_node(run: RunDir, job: str) -> bool:
    """Whether the batch script recorded this job on a single node (``node3``, not ``node[1-2]``)."""
    for record in read_task_records(run).values():
        if str(record.get("job_id")) == job and record.get("nodes"):
            return not any(c in str(record["nodes"]) for c in "[,")
    return False


def unknown_ranks(sources: list[Source]) -> list[str]:
    """``ARRAYID_TASK node`` of each node whose ranks' global ranks are unknown (``--rank``
    cannot find them; ``--node`` can)."""
    return sorted({visible(f"{s.name} {s.node}") for s in sources if s.rank is None and s.local_rank is not None})


def _keep(source: Source, line: str, filters: Filters) -> bool:
    if source.batch and _TEED.match(line):
        return False  # a rank's line: shown from the rank's own file
    return filters.grep is None or bool(filters.grep.search(line))


def _read_new(source: Source) -> list[str]:
    """Complete lines added since the last read (a line still being written waits)."""
    try:  # a regular file only: a FIFO or a link to a device would block or never end
        with os.fdopen(open_regular(source.path), "rb") as fh:
            fh.seek(source.offset)
            data = fh.read()
    except (OSError, DamagedFile):
        return []
    source.offset += len(data)
    text = source.partial + data.decode(errors="replace")
    *lines, source.partial = text.split("\n")
    return lines


def _stamp(line: str, year: int) -> float | None:
    try:
        match = _STAMP.search(line[:40])
        if match:
            return dt.datetime.fromisoformat(match.group(1).replace(" ", "T")).timestamp()
        match = _GLOG.match(line)
        if match:
            month, day, clock = match.groups()
            return dt.datetime.fromisoformat(f"{year}-{month}-{day}T{clock}").timestamp()
        match = _US_STAMP.search(line[:40])
        if match:
            month, day, full_year, clock = match.groups()
            return dt.datetime.fromisoformat(f"{full_year}-{month}-{day}T{clock}").timestamp()
    except ValueError:
        pass
    return None


def _year(path: Path) -> int:
    try:
        return time.localtime(path.stat().st_mtime).tm_year
    except OSError:
        return time.localtime().tm_year


def _rank_in_file(path: Path) -> int | None:
    """A rank's global rank from its own lines (``trainer[3]``), for runs without a rank map."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:
            match = _TRAINER_RANK.search(fh.read(65536))
    except (OSError, DamagedFile):
        return None
    return int(match.group(1)) if match else None


def merged(sources: list[Source], filters: Filters, *, partial_lines: bool = True) -> Iterator[str]:
    """All lines of all sources, merged by timestamp, prefixed. ``partial_lines``: also a last
    line still without its newline (not when following: the rest of it is still to come)."""

    def lines_of(order: int, source: Source) -> Iterator[tuple[float, int, int, str]]:
        lines = _read_new(source)
        if partial_lines and source.partial:
            lines.append(source.partial)
            source.partial = ""
        yield from _stamped(order, source, lines, filters, 0.0)

    for *_, text in heapq.merge(*(lines_of(i, s) for i, s in enumerate(sources))):
        yield text


Stamped = tuple[float, int, int, str]  # (time, source's order, line's order, prefixed line): merge order


def _stamped(order: int, source: Source, lines: list[str], filters: Filters, last: float) -> Iterator[Stamped]:
    """The lines the filters keep, prefixed, each with its time: its own stamp, else the one
    before it (``last``: the time of the line before the first)."""
    year, prefix = _year(source.path), source.prefix
    for i, line in enumerate(lines):
        last = _stamp(line, year) or last
        if _keep(source, line, filters):
            yield last, order, i, f"{prefix} | {line}"


@dataclass
class Tail:
    lines: list[str]  # the newest lines of the merged stream, prefixed, oldest first
    left_out: bool  # whether older lines exist that were not read


# Clocks of nodes and file servers disagree by this much at most: a file last written this long
# before the oldest line kept may still hold a newer line, and is read.
CLOCK_SKEW_S = 60.0


def tail(sources: list[Source], filters: Filters, count: int, *, partial_lines: bool = True) -> Tail:
    """The last ``count`` lines of :func:`merged`'s stream, read from the files' ends: the
    cost grows with ``count`` and the number of files, not with how long the run has been
    logging. Files are read newest first, and one last written before the ``count``-th newest
    line kept so far (less :data:`CLOCK_SKEW_S`) is not read at all. Each source's offset is
    left at its end, so that :func:`follow` goes on from there."""
    newest: list[Stamped] = []  # a heap of at most `count`, oldest on top
    left_out = False
    by_age = sorted(enumerate(sources), key=lambda pair: _mtime(pair[1].path), reverse=True)
    for order, source in by_age:
        if len(newest) >= count and _mtime(source.path) < newest[0][0] - CLOCK_SKEW_S:
            left_out |= _skip_to_end(source)
            continue
        lines, before, cut = _read_tail(source, count, filters, partial_lines)
        left_out |= cut
        for item in _stamped(order, source, lines, filters, before):
            if len(newest) < count:
                heapq.heappush(newest, item)
            else:
                left_out = True
                heapq.heappushpop(newest, item)
    return Tail([text for *_, text in sorted(newest)], left_out)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _skip_to_end(source: Source) -> bool:
    """Mark a source read to its end without reading it; whether it held anything."""
    try:
        source.offset = os.lstat(source.path).st_size
    except OSError:
        return False
    return source.offset > 0


def _read_tail(source: Source, count: int, filters: Filters, partial_lines: bool) -> tuple[list[str], float, bool]:
    """The source's last lines, read backwards a block at a time until they hold ``count``
    lines the filters keep and a stamped line before them (the time of their unstamped
    lines): (the lines, the time of the line before them, whether older lines were left)."""
    try:
        fd = open_regular(source.path)
    except (OSError, DamagedFile):
        return [], 0.0, False
    year = _year(source.path)
    with os.fdopen(fd, "rb") as fh:
        end = os.fstat(fd).st_size
        partial = None
        chunks: list[list[str]] = []  # the complete lines read, a block's at a time, newest first
        kept_in_chunks = 0
        chosen: list[str] | None = None  # the last `count` kept lines and what follows them
        before: float | None = None
        left = False
        for pieces, at_start in lines_backwards(fh, end):
            if partial is None:  # the text after the last newline: a line still being written
                partial = pieces.pop().decode(errors="replace")
            new = [piece.decode(errors="replace") for piece in pieces]
            if chosen is None:
                chunks.append(new)
                kept_in_chunks += sum(_keep(source, line, filters) for line in new)
                if kept_in_chunks < count:
                    continue
                read = [line for chunk in reversed(chunks) for line in chunk]
                first = [i for i, line in enumerate(read) if _keep(source, line, filters)][-count]
                chosen, new = read[first:], read[:first]
                left = bool(new) or not at_start
            before = next((t for t in (_stamp(line, year) for line in reversed(new)) if t), None)
            if before is not None:
                break
    lines = [line for chunk in reversed(chunks) for line in chunk] if chosen is None else chosen
    source.offset, source.partial = end, partial or ""
    if partial_lines and partial:
        lines.append(partial)
        source.partial = ""
    return lines, before or 0.0, left


# While following, a rank's file waits this long for the rank map (written once every rank
# has joined) before its lines are shown with the local rank instead of the global one.
RANK_MAP_WAIT = 15.0


def _waiting_for_rank(source: Source, now: float) -> bool:
    return source.rank is None and source.local_rank is not None and now - source.found_at < RANK_MAP_WAIT


def follow(
    discover: Callable[[], list[Source]],
    filters: Filters,
    echo: Callable[[str], None],
    *,
    interval: float = 0.5,
    until: Callable[[], bool] = lambda: False,
    last: int | None = None,
) -> None:
    """Print what exists (its ``last`` lines, when given), then new lines as they are written,
    from the sources ``discover`` finds now and later, until ``until()`` says so (or Ctrl-C)."""
    known: dict[Path, Source] = {}
    sources = discover()
    now = time.time()
    ready = [s for s in sources if not _waiting_for_rank(s, now)]
    if last is None:
        lines: Iterable[str] = merged(ready, filters, partial_lines=False)
    else:
        lines = tail(ready, filters, last, partial_lines=False).lines
    for line in lines:
        echo(line)
    known.update((s.path, s) for s in sources)
    while not until():
        time.sleep(interval)
        for source in discover():
            # A source found earlier may be named better now (its task's record, the rank map).
            old = known.setdefault(source.path, source)
            old.name, old.rank, old.local_rank = source.name, source.rank, source.local_rank
        now = time.time()
        for source in known.values():
            if _waiting_for_rank(source, now):
                continue
            for line in _read_new(source):
                if _keep(source, line, filters):
                    echo(f"{source.prefix} | {line}")
