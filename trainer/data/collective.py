"""The tokenized data of a job, prepared once for all its ranks: :func:`prepare_dataset`.

Rank 0 decides: it fingerprints the data (reading all of it) and the tokenizer
(:mod:`trainer.data.cache`) and looks for the entry. ``share`` broadcasts what it found (the
entry's name, or that it must be built, or its error) and every rank receives it, so the
collectives always match and a failed rank 0 makes every rank fail at once with its message.

An entry to build is built by every node of the job (:class:`Nodes`): the first rank of each
node tokenizes the shards ``k`` with ``k % nodes == its node's index``, with its node's CPUs,
into the same shard directory of the shared cache; ``gather`` then brings every node's outcome
to rank 0, which publishes the entry once every shard is done, or fails naming the node and
its reason. A node that stops mid-way (killed, lost) breaks the gather; every rank then names
the nodes whose shards were left unfinished, from the records the nodes keep beside their
shards. Nothing is published then, and the shards done stay for the next attempt. A node that
meets bad data removes the shard directory (the data must change); the others stop at their
next shard or progress line instead of tokenizing on, and rank 0 names the bad row. Without
``nodes`` (one process, ``jobgen data prepare``) or for a hub dataset (loaded by rank 0 alone),
rank 0 tokenizes every shard.

Every rank then opens the root and the entry checked, never through a link, and reads the entry
in full before using it (:func:`trainer.data.cache.load_entry`).

Pre-tokenized Arrow (``format = "tokenized"``, a ``save_to_disk`` directory or an ``.arrow``
file) whose every row fits ``max_length`` and has a target is trained on where it lies:
rank 0 checks it (:func:`trainer.data.examples.open_in_place`) and says so, then every rank
maps it; no entry is written. Otherwise (rows to cut or drop, ids the check refuses) it is
prepared into the cache like any source, which counts or names them, and rank 0 logs why.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jobgen.base.atomic import write_json_atomic
from jobgen.base.owned_dir import OwnedDir, Sharing, UntrustedDirectory
from jobgen.base.safe_read import DamagedFile, read_json
from jobgen.base.visible import visible
from jobgen.spec.data_files import is_hub_id
from jobgen.spec.tables.data import DataSpec
from trainer.data.cache import (
    NODES_DIR,
    _open_entry,
    _open_root,
    _work_dir,
    build_entry,
    cache_key,
    hash_path,
    load_entry,
    remove_stale_staging,
    shards_name,
    tokenizer_fingerprint,
)
from trainer.data.examples import DataCacheError, Examples, NotInPlace, arrow_files, open_in_place
from trainer.data.formats import DataError
from trainer.data.prepare import PreparationAbandoned
from trainer.data.stats import DataStats

log = logging.getLogger("trainer.data.collective")


class PreparationStopped(RuntimeError):
    """A node stopped (killed, lost) while the nodes prepared the data. Nothing was published
    and the shards done are kept: unlike a DataCacheError (which stops the run: every attempt
    would repeat it), the next attempt continues, on the nodes it gets."""


@dataclass(frozen=True)
class Nodes:
    """How the ranks of a job share a preparation between their nodes."""

    gather: Callable[[object], list]  # every rank calls it with a value; each gets every rank's, in rank order
    first_on_node: bool  # this rank tokenizes for its node (its LOCAL_RANK is 0)
    name: str  # this rank's node, as the messages name it

    @staticmethod
    def node_name() -> str:
        return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _find(spec: DataSpec, tokenizer, tokenizer_dir, cache_root: Path, sharing: Sharing, *, build: bool):
    """Rank 0's look at the cache: ("entry", fingerprint) when the entry is there (or, with
    ``build``, once it has built it), else ("build", fingerprint, inputs) for every node."""
    with _open_root(cache_root, sharing, create=True) as root:
        remove_stale_staging(root)
        raw = None
        if is_hub_id(spec.path):
            from trainer.data.source import load_raw  # imports datasets: only a hub dataset needs it here

            # No bytes to hash before loading; datasets' own fingerprint pins the revision and files.
            raw = load_raw(spec.path)
            data_hash = f"hub:{spec.path}:{raw._fingerprint}"
            build = True  # loaded here alone: the other nodes could not read it
        else:
            data_hash = hash_path(spec.path)
        fingerprint, inputs = cache_key(spec, data_hash, tokenizer_fingerprint(tokenizer, tokenizer_dir))
        try:
            entry = _open_entry(root, fingerprint)
        except UntrustedDirectory:
            entry = None  # a link, a file or another's directory at the name: build_entry sets it aside
        if entry is not None:
            log.info("data: %s: read from the cache entry %s (prepared before: no tokenizing)", spec.path, entry.path)
            entry.close()
            return ("entry", fingerprint)
        log.info("data: %s: no cache entry %s yet: tokenizing", spec.path, root.path / fingerprint)
        if not build:
            from trainer.data.build import check_columns
            from trainer.data.rows import first_rows, reads_rows_itself

            if reads_rows_itself(spec.path):  # cheap: the first rows; a converted source waits for its nodes
                check_columns(first_rows(spec.path), spec)
            return ("build", fingerprint, inputs)
        build_entry(spec, tokenizer, root, fingerprint, inputs, raw)
    return ("entry", fingerprint)


def _rank0_prepare(
    spec: DataSpec, tokenizer, tokenizer_dir: str | Path | None, cache_root: Path, sharing: Sharing = Sharing.PRIVATE
) -> str:
    """Find or build the entry on this process alone; return its fingerprint (its name)."""
    return _find(spec, tokenizer, tokenizer_dir, cache_root, sharing, build=True)[1]


def _failure(exc: BaseException) -> tuple[str, str]:
    # The class travels as a name and the message as text: any exception pickles that way.
    return ("data" if isinstance(exc, DataError) else "cache", f"{type(exc).__name__}: {exc}")


def _raise(outcome: tuple, rank: int, whose: str) -> None:
    kind, value = outcome[0], outcome[-1]
    # The same class as the failing rank's for bad data, so every rank ends with the same exit code.
    cls = DataError if kind == "data" else DataCacheError
    raise cls(f"rank {rank}: {whose} could not prepare the data (see its log): {value}")


def prepare_dataset(
    data_spec: DataSpec,
    tokenizer,
    tokenizer_dir: str | Path | None,
    cache_root: str | Path,
    *,
    rank: int,
    share: Callable[[object], object],
    sharing: Sharing = Sharing.PRIVATE,
    nodes: Nodes | None = None,
) -> tuple[Examples, DataStats, Path]:
    """The tokenized examples, their stats and their cache entry; collective: every rank calls
    it once (the module's docstring). ``share`` broadcasts rank 0's value (rank 0 passes it and
    gets it back; the others pass None) and must tolerate the whole preparation time (a gloo
    group with a long timeout); ``nodes`` shares the tokenizing between the job's nodes."""
    cache_root = Path(cache_root)
    found = _in_place(data_spec, len(tokenizer), rank, share)
    if found is not None:
        return found
    outcome = _decide(data_spec, tokenizer, tokenizer_dir, cache_root, sharing, rank, share, build=nodes is None)
    if outcome[0] == "build":
        assert nodes is not None
        outcome = _build_on_every_node(data_spec, tokenizer, cache_root, sharing, rank, share, nodes, outcome)
    dataset, stats = _load_published(cache_root, sharing, outcome[1], rank, vocab_size=len(tokenizer))
    return dataset, stats, cache_root / outcome[1]


def _in_place_check(spec: DataSpec, vocab_size: int) -> tuple[tuple, Examples | None]:
    """Rank 0's look at a pre-tokenized source: (("in place", its counts), the examples),
    (("prepare", why not), None), or (("skip",), None) for a source of another kind."""
    try:
        if is_hub_id(spec.path) or arrow_files(Path(spec.path)) is None:
            return ("skip",), None
        examples, targets = open_in_place(Path(spec.path), vocab_size=vocab_size, max_length=spec.max_length)
    except (NotInPlace, DataCacheError) as exc:
        # Rows to cut or drop, or ids the check refuses: the preparation cuts and counts them,
        # or names the file and row of a bad one, as for any other source.
        log.info("data: %s: pre-tokenized Arrow not used in place (%s): prepared into the cache", spec.path, exc)
        return ("prepare", str(exc)), None
    lengths = examples.lengths()
    counts = (len(examples), int(lengths.sum()), targets, int(lengths.max()))
    log.info(
        "data: %s: pre-tokenized Arrow used in place (memory-mapped, nothing copied): %d rows, %d tokens",
        spec.path,
        counts[0],
        counts[1],
    )
    return ("in place", counts), examples


def _in_place(spec: DataSpec, vocab_size: int, rank: int, share) -> tuple[Examples, DataStats, Path] | None:
    """Pre-tokenized Arrow trained on where it lies (the module's docstring), or None."""
    if spec.format != "tokenized":  # the spec alone, the same on every rank: no collective
        return None
    examples = None
    if rank == 0:
        try:
            outcome, examples = _in_place_check(spec, vocab_size)
        except BaseException as exc:
            share(_failure(exc))
            raise
        share(outcome)
    else:
        outcome = share(None)
    if outcome[0] in ("skip", "prepare"):
        return None
    if outcome[0] != "in place":
        _raise(outcome, rank, "rank 0")
    rows, tokens, targets, longest = outcome[1]
    if examples is None:  # the other ranks map it for themselves, and must find what rank 0 found
        try:
            examples, _targets = open_in_place(Path(spec.path), vocab_size=vocab_size, max_length=spec.max_length)
            if (len(examples), int(examples.lengths().sum())) != (rows, tokens):
                raise NotInPlace(f"{len(examples)} rows where rank 0 read {rows}")
        except (NotInPlace, DataCacheError) as exc:
            raise DataError(f"data.path: {spec.path} changed while the job read it: {exc}") from None
    stats = DataStats(rows, rows, 0, 0, tokens, targets, longest)
    return examples, stats, Path(spec.path)


def _decide(spec, tokenizer, tokenizer_dir, cache_root, sharing, rank, share, *, build: bool) -> tuple:
    if rank != 0:
        outcome = share(None)
        if outcome[0] not in ("entry", "build"):
            _raise(outcome, rank, "rank 0")
        return outcome
    try:
        outcome = _find(spec, tokenizer, tokenizer_dir, cache_root, sharing, build=build)
    except BaseException as exc:
        share(_failure(exc))
        raise
    share(outcome)
    return outcome


def _build_on_every_node(spec, tokenizer, cache_root, sharing, rank, share, nodes: Nodes, found) -> tuple:
    """Every node tokenizes its shards, rank 0 publishes (the module's docstring)."""
    _, fingerprint, inputs = found
    firsts = [r for r, (first, _) in enumerate(_gather(nodes, (nodes.first_on_node, nodes.name), rank)) if first]
    mine = None
    if nodes.first_on_node:
        where = (firsts.index(rank), len(firsts), nodes.name)
        mine = _tokenize_mine(spec, tokenizer, cache_root, sharing, fingerprint, inputs, where)
    failed = [result for result in _gather(nodes, mine, rank, cache_root, fingerprint) if result and result[0] != "ok"]
    # The node whose bad data stopped the others first: they only failed to write where it removed.
    failed.sort(key=lambda result: ("data", "cache", "stopped").index(result[0]))
    if rank != 0:
        outcome = share(None)
        if outcome[0] != "entry":
            _raise(outcome, rank, "rank 0")
        return outcome
    try:
        if failed:
            kind, node, message = failed[0]
            raise (DataError if kind == "data" else DataCacheError)(f"node {node}: {message}")
        with _open_root(cache_root, sharing, create=False) as root:
            build_entry(spec, tokenizer, root, fingerprint, inputs)  # every shard is done: publishes
    except BaseException as exc:
        share(_failure(exc))
        raise
    share(("entry", fingerprint))
    return ("entry", fingerprint)


def _tokenize_mine(spec, tokenizer, cache_root, sharing, fingerprint, inputs, where: tuple[int, int, str]) -> tuple:
    """This node's share of the shards (``where``: its index among the nodes, their count, its
    name), tokenized: ("ok", name, "") or (kind, name, message)."""
    index, count, name = where
    record = {"node": name, "share": [index, count]}
    try:
        with _open_root(cache_root, sharing, create=False) as root:
            with _work_dir(root, shards_name(fingerprint)) as work:
                _note(work, index, {**record, "state": "tokenizing"})
                log.info("data: node %s (%d of %d) tokenizes its share of the shards", name, index + 1, count)
                try:
                    build_entry(spec, tokenizer, root, fingerprint, inputs, share=(index, count), publish=False)
                except (DataCacheError, OSError) as exc:
                    if os.fstat(work.fd).st_nlink:
                        raise
                    raise PreparationAbandoned(  # a write into what was removed: not this node's fault
                        "stopped early: the shard directory was removed, as a node that meets bad data removes it"
                    ) from exc
                _note(work, index, {**record, "state": "done"})
            log.info("data: node %s finished its share", name)
        return ("ok", name, "")
    except PreparationAbandoned as exc:  # another node's bad data: its error is the one to name
        log.info("data: node %s %s", name, exc)
        return ("stopped", name, str(exc))
    except (DataError, DataCacheError, OSError, UntrustedDirectory) as exc:
        return ("data" if isinstance(exc, DataError) else "cache", name, str(exc))


def _note(work: OwnedDir, index: int, record: dict) -> None:
    """A node's record beside the shards: what it took on and whether it finished it."""
    directory = work.pinned() / NODES_DIR
    directory.mkdir(mode=0o700, exist_ok=True)
    write_json_atomic(directory / f"node-{index:04d}.json", record)


def _gather(nodes: Nodes, value: object, rank: int, cache_root: Path | None = None, fingerprint: str = "") -> list:
    """Every rank's ``value``; a broken collective (a node stopped) is one line naming the nodes
    that left their shards unfinished, where their records say so."""
    try:
        return nodes.gather(value)
    except RuntimeError as exc:  # gloo's and torch.distributed's errors for a peer that went away
        stopped = _unfinished(cache_root, fingerprint) if cache_root is not None else []
        who = f"node(s) {', '.join(stopped)} stopped while tokenizing" if stopped else "a node stopped"
        raise PreparationStopped(
            f"rank {rank}: the data preparation failed: {who}; nothing was published, and the shards done "
            f"are kept for the next attempt ({str(exc).splitlines()[0][:200]})"
        ) from None


def _unfinished(cache_root: Path, fingerprint: str) -> list[str]:
    directory = cache_root / shards_name(fingerprint) / NODES_DIR
    names = []
    for path in sorted(directory.glob("node-*.json")) if directory.is_dir() else []:
        try:
            record = read_json(path, 1 << 20)  # no link followed, a small regular file
        except (OSError, DamagedFile):
            continue
        if isinstance(record, dict) and record.get("state") == "tokenizing":
            names.append(visible(str(record.get("node")))[:100])
    return names


def _load_published(
    cache_root: Path, sharing: Sharing, name: str, rank: int, *, vocab_size: int
) -> tuple[Examples, DataStats]:
    """The entry rank 0 named, opened as every rank opens it (the root and the entry checked,
    no link followed) and read in full; each refusal one DataCacheError line."""
    try:
        root = _open_root(cache_root, sharing, create=False)
    except FileNotFoundError:
        root = None
    try:
        entry = None if root is None else _open_entry(root, name)
        if entry is None:
            raise DataCacheError(
                f"rank {rank}: no complete preprocessed data at {cache_root / name} after rank 0 prepared it "
                "there; cache_root is not on a filesystem that every node shares (site paths.data_cache)"
            )
        with entry:
            return load_entry(entry, vocab_size=vocab_size)
    except UntrustedDirectory as exc:
        raise DataCacheError(f"rank {rank}: {exc} (the data cache's entry; jobgen reads no entry through it)") from None
    finally:
        if root is not None:
            root.close()
