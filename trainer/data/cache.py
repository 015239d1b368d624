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

Whose cache it is: by default the user's own (``<runs_root>/.data-cache-<uid>``, mode 0700,
owned by the user: a runs root shared with teammates does not share it), or a group's when the
site names one (``paths.data_cache``, group-writable only with the setgid and sticky bits).
Either way the root is opened once and checked (:mod:`jobgen.base.owned_dir`), and everything
rank 0 makes, renames, chmods or removes in it goes through that descriptor and the staging
directory's own, never a path looked up again: a teammate who moves a staging directory aside
and puts a link in its place gets nothing written, removed or chmodded through the link. Every
rank opens the entry the same way and validates it in full before use (Examples.open: schema,
offsets, ids within the vocabulary), so an entry someone else published is only data.

The tokenizing itself is :func:`trainer.data.build.build_dataset`, this module's one call
into :mod:`trainer.data.build`; a hub dataset is loaded here (:mod:`trainer.data.source`)
only because its fingerprint comes from ``datasets``, and the counts are read and
written with :mod:`trainer.data.stats`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from jobgen.base.atomic import fsync_tree
from jobgen.base.owned_dir import OwnedDir, Sharing, UntrustedDirectory
from jobgen.base.safe_read import DamagedFile
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
# The most files a staging directory's age is read from: a build writes a few dozen.
_MOST_STAGING_FILES = 100_000
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
    """Where the run's tokenized data is cached: the site's paths.data_cache (shared with a group
    when the site makes it so), else a directory of the user's own in the runs root. A shared runs
    root must not make a shared cache by accident: the default is per user, ``.data-cache-<uid>``."""
    if spec.site.paths.data_cache:
        return Path(spec.site.paths.data_cache)
    return spec.runs_root / f".data-cache-{os.geteuid()}"


def cache_sharing(spec: ResolvedSpec) -> Sharing:
    """How the cache root is trusted (jobgen.base.owned_dir): the site's data_cache may be a
    group's directory (setgid and sticky), the default one is the user's alone."""
    return Sharing.GROUP if spec.site.paths.data_cache else Sharing.PRIVATE


def _regular(directory: OwnedDir, name: str) -> bool:
    try:
        return stat.S_ISREG(directory.lstat(name).st_mode)
    except FileNotFoundError:
        return False


def _open_entry(root: OwnedDir, name: str) -> OwnedDir | None:
    """The complete entry ``name`` (opened, checked: never through a link), or None when there
    is none or it is incomplete."""
    try:
        entry = root.subdir(name)
    except FileNotFoundError:
        return None
    try:
        with entry.subdir("dataset") as dataset:
            complete = _regular(entry, "stats.json") and _regular(dataset, "state.json")
    except FileNotFoundError:
        complete = False
    except BaseException:
        entry.close()
        raise
    if not complete:
        entry.close()
        return None
    return entry


def _stale(root: OwnedDir, name: str, now: float, older_than_s: float) -> bool:
    newest = max(st.st_mtime for st in root.walk_stats(name, limit=_MOST_STAGING_FILES))
    return now - newest > older_than_s


def remove_stale_staging(root: OwnedDir, *, older_than_s: float = STALE_AFTER_S) -> list[str]:
    """Delete the user's staging directories nothing has written to for ``older_than_s``
    (killed builds), and anything else at a staging name that is no directory (a link: removed
    as itself, never walked). A teammate's staging in a group's cache is theirs to remove."""
    removed = []
    now = time.time()
    me = os.geteuid()
    for name in root.names():
        if not name.startswith(STAGING_PREFIX):
            continue
        try:
            st = root.lstat(name)
            if st.st_uid != me:
                continue
            if not stat.S_ISDIR(st.st_mode):
                root.unlink(name)
            elif _stale(root, name, now, older_than_s):
                root.remove_tree(name)
            else:
                continue
            removed.append(name)
        except FileNotFoundError:
            pass  # another job removed it first
    return removed


def _set_aside(root: OwnedDir, name: str) -> None:
    """An incomplete directory (or a link, or a file) at an entry's name: not something this
    module leaves behind; moved to a staging name of its own and removed, never followed."""
    aside = f"{STAGING_PREFIX}broken-{name[:16]}-{secrets.token_hex(4)}"
    try:
        root.rename(name, aside)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise DataCacheError(
            f"{root.path / name}: an incomplete cache entry that cannot be moved aside ({exc.strerror}); "
            "whoever owns it must remove it"
        ) from None
    root.remove_tree(aside)


def build_entry(
    spec: DataSpec,
    tokenizer,
    root: OwnedDir,
    fingerprint: str,
    inputs: dict,
    raw: datasets.Dataset | None = None,
) -> None:
    """Tokenize into a staging directory of the user's own and rename it to ``<fingerprint>``.

    If another builder's rename got there first, ours is discarded and theirs used. Everything is
    written inside the staging directory through its descriptor (``OwnedDir.pinned``): a rename
    or a link put at its name meanwhile cannot send a write, a delete or a chmod elsewhere.
    """
    try:
        root.lstat(fingerprint)
        _set_aside(root, fingerprint)  # there but not complete: the caller looked
    except FileNotFoundError:
        pass
    name = f"{STAGING_PREFIX}{fingerprint[:16]}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    staging = root.make_subdir(name, 0o700)
    from trainer.data.build import build_dataset  # imports datasets: only a build needs it

    try:
        here = staging.pinned()
        # The one call into trainer.data.build: everything it writes stays in the staging directory.
        tokenized, stats = build_dataset(spec, tokenizer, raw=raw, raw_dir=here / "raw", work_dir=here / "work")
        tokenized.save_to_disk(str(here / "dataset"))
        del tokenized, raw  # drop the memory maps before deleting what they map
        for scratch in ("work", "raw"):
            staging.remove_tree(scratch)
        write_stats(here / "stats.json", stats, {"fingerprint": fingerprint, "source": spec.path, "inputs": inputs})
        fsync_tree(here)  # the rename must not publish files a node crash could still lose
        # A group's cache: its members read the entry; the user's own: the root already hides it.
        os.fchmod(staging.fd, 0o755 if root.sharing is Sharing.GROUP else 0o700)
        if not os.path.samestat(root.lstat(name), os.fstat(staging.fd)):
            raise DataCacheError(f"{root.path / name}: the staging directory was moved while tokenizing")
        try:
            root.rename(name, fingerprint)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            complete = _open_entry(root, fingerprint)
            if complete is None:
                raise
            complete.close()
            # Another job's rank 0 finished the same entry first: identical content, use theirs.
        else:
            root.fsync()
    finally:
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(root.lstat(name), os.fstat(staging.fd)):
                root.remove_tree(name)
        staging.close()


def load_entry(entry: OwnedDir, vocab_size: int | None = None) -> tuple[Examples, DataStats]:
    # A cache others may write is data, never code: Examples.open reads JSON and Arrow streams
    # and checks them in full, and stats.json is JSON. Nothing here unpickles. Both are read
    # through the entry's descriptor (a link or a rename at its names meanwhile changes nothing);
    # errors name the entry's path, not /proc's.
    names = {str(entry.pinned()): str(entry.path)}
    try:
        with entry.subdir("dataset") as dataset:
            names[str(dataset.pinned())] = str(dataset.path)
            examples = Examples.open(dataset.pinned(), vocab_size=vocab_size)
        stats = read_stats(entry.pinned() / "stats.json")
    except (DataCacheError, UntrustedDirectory, DamagedFile, FileNotFoundError, ValueError) as exc:
        text = str(exc)
        for pinned, path in sorted(names.items(), key=lambda item: -len(item[0])):
            text = text.replace(pinned, path)
        raise DataCacheError(f"{text}; remove the cache entry {entry.path} and the next start rebuilds it") from None
    return examples, stats


def _open_root(cache_root: Path, sharing: Sharing, *, create: bool) -> OwnedDir:
    """The cache root, checked as ``sharing`` says; a refusal is one DataCacheError line."""
    try:
        if create:
            return OwnedDir.ensure(cache_root, 0o700, sharing)
        return OwnedDir.open(cache_root, sharing)
    except UntrustedDirectory as exc:
        where = "the site's paths.data_cache" if sharing is Sharing.GROUP else "the data cache"
        raise DataCacheError(f"{exc} ({where}; jobgen refuses to tokenize into it or read from it)") from None


# --------------------------------------------------------------------------- the collective entry point


def _rank0_prepare(
    spec: DataSpec, tokenizer, tokenizer_dir: str | Path | None, cache_root: Path, sharing: Sharing = Sharing.PRIVATE
) -> str:
    """Find or build the entry; return its fingerprint (the entry's name under ``cache_root``)."""
    with _open_root(cache_root, sharing, create=True) as root:
        remove_stale_staging(root)
        raw = None
        if is_hub_id(spec.path):
            from trainer.data.source import load_raw  # imports datasets: only a hub dataset needs it here

            # No bytes to hash before loading; datasets' own fingerprint pins the revision and files.
            raw = load_raw(spec.path)
            data_hash = f"hub:{spec.path}:{raw._fingerprint}"
        else:
            data_hash = hash_path(spec.path)
        fingerprint, inputs = cache_key(spec, data_hash, tokenizer_fingerprint(tokenizer, tokenizer_dir))
        try:
            entry = _open_entry(root, fingerprint)
        except UntrustedDirectory:
            entry = None  # a link, a file or another's directory at the name: build_entry sets it aside
        if entry is None:
            build_entry(spec, tokenizer, root, fingerprint, inputs, raw)
        else:
            entry.close()
    return fingerprint


def prepare_dataset(
    data_spec: DataSpec,
    tokenizer,
    tokenizer_dir: str | Path | None,
    cache_root: str | Path,
    *,
    rank: int,
    share: Callable[[object], object],
    sharing: Sharing = Sharing.PRIVATE,
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

    ``sharing`` says how the cache root is trusted (:func:`cache_sharing`); every rank opens it
    and the entry checked, never through a link, and reads the entry in full before using it.

    ``share`` must tolerate the whole preprocessing time (e.g. a broadcast on a
    gloo group created with a long timeout): a default 10-minute collective
    timeout is shorter than tokenizing a large dataset.
    """
    cache_root = Path(cache_root)
    if rank == 0:
        error: BaseException | None = None
        try:
            fingerprint = _rank0_prepare(data_spec, tokenizer, tokenizer_dir, cache_root, sharing)
            outcome: tuple[str, str] = ("entry", fingerprint)
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
    dataset, stats = _load_published(cache_root, sharing, outcome[1], rank, vocab_size=len(tokenizer))
    return dataset, stats, cache_root / outcome[1]


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
