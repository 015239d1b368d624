"""Tokenizing a source shard by shard, in memory that does not grow with it.

The rows (:mod:`trainer.data.rows`) are cut by index into shards of :data:`SHARD_ROWS` rows.
A shard is read, formatted and tokenized :data:`BATCH_ROWS` rows at a time
(:class:`trainer.data.encoder.Encoder`), its kept examples written batch by batch to an Arrow
stream file (``data-0000k-of-0000n.arrow``, the file ``save_to_disk`` would write) and its
counts to ``done/shard-0000k.json``; nothing holds more than a batch. The file is written under
a temporary name, fsynced and renamed, and the counts only after it: a shard is done when its
counts are there, and a kill leaves at most a ``.part-*`` file that nothing reads.

The shards depend on the row count alone, never on how many processes or nodes tokenize them,
so an entry is the same bytes whoever built it; a preparation that stopped part-way continues
with the shards not yet done. :func:`tokenize_shards` runs a list of shards in this process or
in ``processes`` worker processes (started afresh, :mod:`trainer.data.shard_worker`: the
caller may hold threads, a process group and CUDA, none of which survive a fork), logging
rows/s and ETA; :func:`finish_dataset` adds the
counts and writes ``state.json`` and ``dataset_info.json`` once every shard is done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import secrets
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow as pa

from jobgen.base.atomic import write_json_atomic
from jobgen.base.safe_read import DamagedFile, is_int, read_json
from jobgen.spec.tables.data import DataSpec
from trainer.data.examples import DataCacheError
from trainer.data.formats import DataError
from trainer.data.rows import RowSource

log = logging.getLogger("trainer.data.prepare")

# Rows per batch: one batched tokenizer call each; what a process holds at a time.
BATCH_ROWS = 1000
PROGRESS_LOG_SECONDS = 30.0
DONE_DIR = "done"
_FEATURES = {
    "input_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"},
    "labels": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"},
    "length": {"dtype": "int32", "_type": "Value"},
}
# The schema datasets writes for these features (its metadata lets datasets.load_from_disk read it).
SCHEMA = pa.schema(
    [("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())), ("length", pa.int32())],
    metadata={"huggingface": json.dumps({"info": {"features": _FEATURES}})},
)


def data_file_name(shard: int, shards: int) -> str:
    return f"data-{shard:05d}-of-{shards:05d}.arrow"


def _done_name(shard: int) -> str:
    return f"shard-{shard:05d}.json"


@dataclass
class ShardCounts:
    """What tokenizing some rows did (summed over shards into DataStats)."""

    examples_in: int = 0
    kept: int = 0
    truncated: int = 0
    total_tokens: int = 0
    target_tokens: int = 0
    longest: int = 0
    learnable: int = 0  # rows with a target token before truncation: none means nothing to learn

    def add(self, other: ShardCounts) -> None:
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            setattr(self, field.name, max(mine, theirs) if field.name == "longest" else mine + theirs)

    @classmethod
    def read(cls, path: Path) -> ShardCounts:
        """A shard's counts; DataCacheError naming the file when it is not one."""
        try:
            data = read_json(path, 1 << 16)
        except DamagedFile as exc:
            raise DataCacheError(f"{exc} (a shard's counts)") from None
        names = [field.name for field in fields(cls)]
        if not isinstance(data, dict) or not all(is_int(data.get(n)) and data[n] >= 0 for n in names):
            raise DataCacheError(f"{path}: not a shard's counts ({', '.join(names)})")
        return cls(**{n: data[n] for n in names})


def _record_batch(out: dict[str, list[Any]], keep: list[int]) -> pa.RecordBatch:
    ids = pa.array([out["input_ids"][k] for k in keep], type=pa.list_(pa.int32()))
    labels = pa.array([out["labels"][k] for k in keep], type=pa.list_(pa.int32()))
    length = pa.array([out["length"][k] for k in keep], type=pa.int32())
    return pa.RecordBatch.from_arrays([ids, labels, length], schema=SCHEMA)


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """A batch of rows as columns (a key some rows lack is None there, as datasets reads it)."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    return {name: [row.get(name) for row in rows] for name in names}


@dataclass(frozen=True)
class ShardWork:
    """What a process needs to tokenize shards: everything picklable."""

    source: RowSource
    spec: DataSpec
    tokenizer: Any
    dataset_dir: str  # where the data files go (a pinned path: /proc/<pid>/fd/<fd>)
    done_dir: str
    shard_rows: int  # rows per shard: the unit of work of a process and of a node, and a data file's

    @property
    def shards(self) -> int:
        return max(1, -(-self.source.rows // self.shard_rows))

    def bounds(self, shard: int) -> tuple[int, int]:
        return shard * self.shard_rows, min((shard + 1) * self.shard_rows, self.source.rows)


def tokenize_shard(work: ShardWork, shard: int, encoder, advance: Callable[[int], None]) -> ShardCounts:
    """Tokenize one shard into its data file, then write its counts (see the module's docstring)."""
    shards = work.shards
    start, stop = work.bounds(shard)
    directory = Path(work.dataset_dir)
    part = directory / f".part-{shard:05d}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    counts, index = ShardCounts(), start
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            with pa.ipc.new_stream(fh, SCHEMA) as writer:
                for rows in work.source.read(start, stop, BATCH_ROWS):
                    out = encoder(_columns(rows), range(index, index + len(rows)))
                    index += len(rows)
                    keep = [k for k, targets in enumerate(out["targets"]) if targets > 0]
                    counts.add(_batch_counts(out, keep, work.spec.max_length))
                    writer.write_batch(_record_batch(out, keep))
                    advance(len(rows))
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(part, directory / data_file_name(shard, shards))
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    write_json_atomic(Path(work.done_dir) / _done_name(shard), asdict(counts))
    return counts


def _batch_counts(out: dict[str, list[Any]], keep: list[int], max_length: int) -> ShardCounts:
    return ShardCounts(
        examples_in=len(out["length"]),
        kept=len(keep),
        truncated=sum(1 for n in out["full_length"] if n > max_length),
        total_tokens=sum(out["length"][k] for k in keep),
        target_tokens=sum(out["targets"][k] for k in keep),
        longest=max(out["full_length"], default=0),
        learnable=sum(1 for n in out["full_targets"] if n > 0),
    )


def pending_shards(work: ShardWork, shards: Sequence[int]) -> list[int]:
    """The shards of ``shards`` whose counts are not written yet (the others are done)."""
    done = set(os.listdir(work.done_dir))
    return [k for k in shards if _done_name(k) not in done]


class PreparationAbandoned(RuntimeError):
    """The shard directory this node tokenizes into was removed under it: another node met bad
    data (which removes it: the data must change). This node's share stops early."""


def _removed(directory: str) -> bool:
    """Whether ``directory`` (a pinned path) was removed: a removed directory has no links; on
    a network filesystem, a stale handle."""
    try:
        return os.stat(directory).st_nlink == 0
    except OSError:
        return True


class Progress:
    """Rows tokenized so far, logged every PROGRESS_LOG_SECONDS with their rate and the ETA;
    with ``work`` (a node's share), also the shards every node has done, and a stop
    (PreparationAbandoned) once another node's bad data removed the shard directory."""

    def __init__(self, total: int, label: str, work: ShardWork | None = None):
        self.total, self.label, self.work = total, label, work
        self.started = self.logged = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.logged < PROGRESS_LOG_SECONDS:
            return
        self.logged = now
        across = ""
        if self.work is not None:
            if _removed(self.work.done_dir):
                raise PreparationAbandoned(
                    "stopped early: the shard directory was removed, as a node that meets bad data removes it"
                )
            finished = sum(1 for name in os.listdir(self.work.done_dir) if name.startswith("shard-"))
            across = f"; all nodes: {finished} of {self.work.shards} shards done"
        rate = done / max(now - self.started, 1e-9)
        eta = max(0, self.total - done) / max(rate, 1e-9)
        log.info(
            "tokenizing %s: %s/%s rows (%.0f%%), %.0f rows/s, ETA %ds%s",
            self.label,
            f"{done:,}",
            f"{self.total:,}",
            100 * done / max(self.total, 1),
            rate,
            eta,
            across,
        )


def _encoder(work: ShardWork):
    from trainer.data.encoder import Encoder

    return Encoder(work.spec, work.tokenizer, work.source.path)


def tokenize_shards(work: ShardWork, shards: Sequence[int], processes: int, label: str, *, share: bool = False) -> None:
    """Tokenize ``shards`` (those not done yet), in this process or in ``processes`` spawned
    workers; a row's DataError or a worker's death stops them all and is raised here. ``share``:
    these are a node's share of the shards (:class:`Progress` watches the other nodes too)."""
    shards = pending_shards(work, shards)
    if not shards:
        return
    rows = sum(work.bounds(k)[1] - work.bounds(k)[0] for k in shards)
    progress = Progress(rows, label, work if share else None)
    processes = max(1, min(processes, len(shards)))
    log.info("tokenizing %s rows in %d shard(s) with %d process(es)", f"{rows:,}", len(shards), processes)
    if processes == 1:
        encoder, done = _encoder(work), 0
        for shard in shards:

            def advance(n: int) -> None:
                nonlocal done
                done += n
                progress.update(done)

            tokenize_shard(work, shard, encoder, advance)
        return
    _in_workers(work, shards, processes, progress)


def _worker_command() -> tuple[list[str], dict[str, str]]:
    """How a worker is started: this Python, with this process's import path (a checkout's
    trainer, or the installed one), never re-running the caller's main module."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # the processes already use the CPUs
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return [sys.executable, "-m", "trainer.data.shard_worker"], env


def _in_workers(work: ShardWork, shards: list[int], processes: int, progress: Progress) -> None:
    """Run ``shards`` in ``processes`` workers (:mod:`trainer.data.shard_worker`): each is sent
    the work once, then a shard at a time; it answers a line per batch and per shard."""
    command, env = _worker_command()
    todo, left, done = list(shards), set(shards), 0
    workers = [
        subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        for _ in range(processes)
    ]
    selector, pending = selectors.DefaultSelector(), {worker.pid: b"" for worker in workers}
    finished: set[int] = set()  # the workers told there are no more shards
    try:
        for worker in workers:
            worker.stdin.write(pickle_work(work))
            _send(worker, todo, finished)
            selector.register(worker.stdout, selectors.EVENT_READ, worker)
        while left:
            for key, _ in selector.select(timeout=PROGRESS_LOG_SECONDS):
                worker, chunk = key.data, os.read(key.fileobj.fileno(), 1 << 16)
                if not chunk and worker.pid in finished:
                    selector.unregister(key.fileobj)  # told there was no more: it ended
                    continue
                if not chunk:
                    raise DataCacheError(
                        f"a tokenizing process (pid {worker.pid}) died (exit code {worker.wait()}) "
                        f"with shard(s) {sorted(left)[:5]} not done"
                    )
                *lines, pending[worker.pid] = (pending[worker.pid] + chunk).split(b"\n")
                for line in lines:
                    done += _answer(json.loads(line), worker, todo, left, finished)
            progress.update(done)
    finally:
        selector.close()
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
            for pipe in (worker.stdin, worker.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()


def _answer(message: dict, worker: subprocess.Popen, todo: list[int], left: set[int], finished: set[int]) -> int:
    """Act on one line of a worker's; the rows it tokenized."""
    if "rows" in message:
        return message["rows"]
    if "done" in message:
        left.discard(message["done"])
        _send(worker, todo, finished)
        return 0
    if message.get("kind") == "data":
        raise DataError(message["error"])
    raise DataCacheError(f"tokenizing shard {message.get('shard')} failed: {message['error']}")


def pickle_work(work: ShardWork) -> bytes:
    """The work as a worker reads it: its length, then its pickle (the worker is this program,
    fed through a pipe by this process: nothing from disk is unpickled)."""
    data = pickle.dumps(work, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(8, "little") + data


def _send(worker: subprocess.Popen, todo: list[int], finished: set[int]) -> None:
    """The next shard to ``worker``, or -1 (and it is noted as finished) when none is left."""
    if not todo:
        finished.add(worker.pid)
    worker.stdin.write(f"{todo.pop(0) if todo else -1}\n".encode())
    worker.stdin.flush()


def shard_totals(done_dir: Path, shards: int) -> ShardCounts:
    """The counts of every shard, added; DataCacheError when one is missing."""
    total = ShardCounts()
    for shard in range(shards):
        path = done_dir / _done_name(shard)
        if not path.exists():
            raise DataCacheError(f"{path}: missing: shard {shard} of {shards} was never finished")
        total.add(ShardCounts.read(path))
    return total


def finish_dataset(dataset_dir: Path, shards: int) -> None:
    """``state.json`` and ``dataset_info.json`` of the complete set of data files, as
    ``save_to_disk`` writes them (datasets.load_from_disk reads the entry too)."""
    for name in os.listdir(dataset_dir):
        if name.startswith(".part-"):
            os.unlink(dataset_dir / name)  # a killed attempt's unfinished file
    files = [{"filename": data_file_name(k, shards)} for k in range(shards)]
    state = {
        "_data_files": files,
        "_fingerprint": "jobgen",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = {"features": _FEATURES}
    write_json_atomic(dataset_dir / "dataset_info.json", info)
    write_json_atomic(dataset_dir / "state.json", state)
