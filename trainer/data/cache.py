"""Tokenize once per (data, tokenizer, format): a shared on-disk cache that a kill cannot break.

Layout under ``cache_root``::

    <fingerprint>/dataset/     the tokenized datasets.Dataset (save_to_disk), read as Examples
    <fingerprint>/stats.json   DataStats + what the fingerprint was made of
    .tmp-<fp>-<host>-<pid>-*/  a build in progress (or one a kill left behind)

The fingerprint covers the data's content (bytes of the file, or of every file of
a directory), the tokenizer (its full serialisation and chat template), the
format, template, response and text columns, ``max_length`` and
:data:`CODE_VERSION`. Packing is not in it: rows are packed at load time.

Only rank 0 ever tokenizes, into a private staging directory holding every
intermediate Arrow file (``datasets.map`` run by every rank against one shared
cache is the known way to crash on a missing Arrow file). The staging directory
is renamed to ``<fingerprint>`` only when complete, so the entry either exists
whole or not at all: a rank 0 killed mid-way leaves only a ``.tmp-*`` directory,
which later runs ignore and remove once it is an hour old. If two jobs build the
same entry at once, the first rename wins and the other job discards its copy
and uses the winner's. Only rank 0 reads the data to fingerprint it; it broadcasts
the entry's name (or its error) once, every rank receives it, then loads the entry
read-only (memory-mapped, :class:`trainer.data.examples.Examples`). Only a build imports
``datasets`` (and :mod:`trainer.data.build`, :mod:`trainer.data.source`): a start on a warm
cache does without it, a CPU-second less on every rank.

The tokenizing itself is :func:`trainer.data.build.build_dataset`, this module's one call
into :mod:`trainer.data.build`; a hub dataset is loaded here (:mod:`trainer.data.source`)
only because its fingerprint comes from ``datasets``, and the counts are read and
written with :mod:`trainer.data.stats`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from jobgen.base.atomic import fsync_dir, fsync_tree
from jobgen.spec.data_files import is_hub_id
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.data import DataSpec
from trainer.data.examples import DataCacheError, Examples
from trainer.data.formats import DataError
from trainer.data.stats import DataStats, read_stats, write_stats

if TYPE_CHECKING:
    import datasets

# Bump when the tokenized output for the same inputs changes (formatting, masking, columns).
CODE_VERSION = 1

STAGING_PREFIX = ".tmp-"
STALE_AFTER_S = 3600.0
_HASH_CHUNK = 1 << 20
# Files in a tokenizer directory that never affect tokenization, skipped when hashing it.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


# --------------------------------------------------------------------------- fingerprints


def _hash_file(h: hashlib._Hash, path: Path) -> None:
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)


def hash_path(path: str | Path, *, skip_suffixes: tuple[str, ...] = ()) -> str:
    """sha256 of a file's bytes, or of a directory's files (relative names, sizes and bytes, sorted)."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file():
        _hash_file(h, p)
        return h.hexdigest()
    files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.endswith(skip_suffixes))
    for f in files:
        rel = f.relative_to(p).as_posix()
        h.update(f"{len(rel)}:{rel}:{f.stat().st_size}:".encode())
        _hash_file(h, f)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer, tokenizer_dir: str | Path | None) -> str:
    """Everything about the tokenizer that changes token ids: its full serialisation and template.

    A fast tokenizer serialises completely (normaliser, pre-tokeniser, vocab,
    merges, post-processor, added tokens); for a slow one the directory's files
    are hashed instead.
    """
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    elif tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        h.update(hash_path(tokenizer_dir, skip_suffixes=_WEIGHT_SUFFIXES).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = {
        "class": type(tokenizer).__name__,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "n": len(tokenizer),
    }
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(spec: DataSpec, data_hash: str, tokenizer_hash: str) -> tuple[str, dict]:
    """The entry's name and the inputs it was made from (kept in stats.json for humans)."""
    inputs = {
        "code_version": CODE_VERSION,
        "data": data_hash,
        "tokenizer": tokenizer_hash,
        "format": spec.format,
        "template": spec.template,
        "response_column": spec.response_column,
        "text_column": spec.text_column,
        "max_length": spec.max_length,
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return digest[:32], inputs


# --------------------------------------------------------------------------- entries


def cache_root(spec: ResolvedSpec) -> Path:
    """Where the run's tokenized data is cached: the site's paths.data_cache, else under the runs root."""
    return Path(spec.site.paths.data_cache) if spec.site.paths.data_cache else spec.runs_root / ".cache" / "data"


def is_complete(entry: Path) -> bool:
    return (entry / "stats.json").is_file() and (entry / "dataset" / "state.json").is_file()


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except FileNotFoundError:
                pass
    return newest


def remove_stale_staging(cache_root: Path, *, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Delete staging directories nothing has written to for ``older_than_s`` (killed builds)."""
    removed = []
    now = time.time()
    for entry in cache_root.glob(STAGING_PREFIX + "*"):
        try:
            if entry.is_dir() and now - _newest_mtime(entry) > older_than_s:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        except FileNotFoundError:
            pass  # another job removed it first
    return removed


def build_entry(
    spec: DataSpec,
    tokenizer,
    cache_root: Path,
    fingerprint: str,
    inputs: dict,
    raw: datasets.Dataset | None = None,
) -> Path:
    """Tokenize into a staging directory and rename it to ``<fingerprint>``; return the entry.

    If another builder's rename got there first, ours is discarded and theirs returned.
    """
    final = cache_root / fingerprint
    if final.exists() and not is_complete(final):
        # Not something this module leaves behind; set it aside rather than trust it.
        aside = cache_root / f"{STAGING_PREFIX}broken-{fingerprint}-{os.getpid()}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    staging = Path(
        tempfile.mkdtemp(
            prefix=f"{STAGING_PREFIX}{fingerprint[:16]}-{socket.gethostname()}-{os.getpid()}-", dir=cache_root
        )
    )
    from trainer.data.build import build_dataset  # imports datasets: only a build needs it

    try:
        # The one call into trainer.data.build: everything it writes stays in the staging directory.
        tokenized, stats = build_dataset(spec, tokenizer, raw=raw, raw_dir=staging / "raw", work_dir=staging / "work")
        tokenized.save_to_disk(str(staging / "dataset"))
        del tokenized, raw  # drop the memory maps before deleting what they map
        for scratch in ("work", "raw"):
            shutil.rmtree(staging / scratch, ignore_errors=True)
        write_stats(staging / "stats.json", stats, {"fingerprint": fingerprint, "source": spec.path, "inputs": inputs})
        fsync_tree(staging)  # the rename must not publish files a node crash could still lose
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the cache from the rest of the team
        try:
            os.rename(staging, final)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_complete(final):
                raise
            # Another job's rank 0 finished the same entry first: identical content, use theirs.
        else:
            fsync_dir(cache_root)
        return final
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def load_entry(entry: Path) -> tuple[Examples, DataStats]:
    # A shared cache a teammate can write is data, never code: Examples.open reads JSON and
    # Arrow streams, and stats.json is JSON. Nothing here unpickles.
    try:
        examples = Examples.open(entry / "dataset")
    except DataCacheError as exc:
        raise DataCacheError(f"{exc}; remove the cache entry {entry} and the next start rebuilds it") from None
    return examples, read_stats(entry / "stats.json")


# --------------------------------------------------------------------------- the collective entry point


def _rank0_prepare(spec: DataSpec, tokenizer, tokenizer_dir: str | Path | None, cache_root: Path) -> str:
    """Find or build the entry; return its fingerprint (the entry's name under ``cache_root``)."""
    cache_root.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(cache_root)
    raw = None
    if is_hub_id(spec.path):
        from trainer.data.source import load_raw  # imports datasets: only a hub dataset needs it here

        # No bytes to hash before loading; datasets' own fingerprint pins the revision and files.
        raw = load_raw(spec.path)
        data_hash = f"hub:{spec.path}:{raw._fingerprint}"
    else:
        data_hash = hash_path(spec.path)
    fingerprint, inputs = cache_key(spec, data_hash, tokenizer_fingerprint(tokenizer, tokenizer_dir))
    if not is_complete(cache_root / fingerprint):
        build_entry(spec, tokenizer, cache_root, fingerprint, inputs, raw)
    return fingerprint


def prepare_dataset(
    data_spec: DataSpec,
    tokenizer,
    tokenizer_dir: str | Path | None,
    cache_root: str | Path,
    *,
    rank: int,
    share: Callable[[object], object],
) -> tuple[Examples, DataStats, Path]:
    """The tokenized examples, their stats and their cache entry; collective: every rank calls it once.

    Rank 0 alone decides: it fingerprints the data (reading all of it) and the
    tokenizer, and builds the entry if it is missing. ``share`` broadcasts rank 0's
    outcome (rank 0 passes it and gets it back; the others pass None and receive
    it): the entry's name, or rank 0's error. Every rank calls ``share`` exactly
    once, whatever rank 0 found (hit, miss, error), so the collectives always
    match; a failed rank 0 makes every other rank fail at once with its message
    instead of waiting. The other ranks never read the data themselves: with a
    warm cache a start costs one read of the dataset, not one per rank.

    ``share`` must tolerate the whole preprocessing time (e.g. a broadcast on a
    gloo group created with a long timeout): a default 10-minute collective
    timeout is shorter than tokenizing a large dataset.
    """
    cache_root = Path(cache_root)
    if rank == 0:
        error: BaseException | None = None
        try:
            outcome: tuple[str, str] = ("entry", _rank0_prepare(data_spec, tokenizer, tokenizer_dir, cache_root))
        except BaseException as exc:  # noqa: BLE001 - even an interrupt: the others must not wait hours in share()
            error = exc
            # The class travels as a name and the message as text: any exception pickles that way.
            kind = "data" if isinstance(exc, DataError) else "cache"
            outcome = (kind, f"{type(exc).__name__}: {exc}")
        share(outcome)
        if error is not None:
            raise error
    else:
        outcome = share(None)  # type: ignore[assignment]
        kind, value = outcome
        if kind != "entry":
            # The same class as rank 0's for bad data, so every rank ends with the same exit code.
            cls = DataError if kind == "data" else DataCacheError
            raise cls(f"rank {rank}: rank 0 could not prepare the data (see its log): {value}")
    entry = cache_root / outcome[1]
    if not is_complete(entry):
        raise DataCacheError(
            f"rank {rank}: no complete preprocessed data at {entry} after rank 0 prepared it there; "
            "cache_root is not on a filesystem that every node shares (site paths.data_cache)"
        )
    dataset, stats = load_entry(entry)
    return dataset, stats, entry
