"""Tokenize once per (data, tokenizer, format): a shared on-disk cache that a kill cannot break.

Layout under ``cache_root``::

    <fingerprint>/dataset/           the tokenized examples (as save_to_disk writes them), read as Examples
    <fingerprint>/stats.json         DataStats + what the fingerprint was made of
    .shards-<fp>-<uid>/              a build in progress, or one stopped part-way: its shards done,
        dataset/data-*.arrow         ... each written whole (temp, fsync, rename) ...
        done/shard-*.json            ... and counted once written: what the next attempt skips
        nodes/node-*.json            which node took which share (trainer.data.collective)
    .tmp-<fp>-<host>-<pid>-*/        a complete build being published (or one a kill left behind)

The fingerprint covers the data's content (bytes of the file, or of every file of
a directory), the tokenizer (its full serialisation and chat template), the
format, template, response and text columns, ``max_length`` and
:data:`CODE_VERSION`. Packing is not in it: rows are packed at load time.

A build (:func:`build_entry`) tokenizes into the user's shard directory for the fingerprint
(:mod:`trainer.data.prepare`: shards that depend on the row count alone, so any number of
processes and nodes writes the same files). It outlives a build that was stopped: the next
attempt does only the shards not done, and it is removed after SHARDS_STALE_AFTER_S untouched.
When every shard is done it is renamed to a ``.tmp-*`` name of its publisher's (no other job
finishes it too), its bookkeeping dropped, fsynced and renamed to ``<fingerprint>``: the entry
either exists whole or not at all. If two jobs build the same entry at once, the first rename
wins and the other uses the winner's. The collective around it (who fingerprints, who
tokenizes which share, who publishes) is :mod:`trainer.data.collective`; a start on a warm
cache imports neither ``datasets`` nor the tokenizing code.

Whose cache it is: by default the user's own (``<runs_root>/.data-cache-<uid>``, mode 0700,
owned by the user: a runs root shared with teammates does not share it), or a group's when the
site names one (``paths.data_cache``, group-writable only with the setgid and sticky bits).
Either way the root is opened once and checked (:mod:`jobgen.base.owned_dir`), and everything
a build makes, renames, chmods or removes in it goes through that descriptor and the shard
directory's own, never a path looked up again: a teammate who moves a directory aside and puts
a link in its place gets nothing written, removed or chmodded through the link. Every rank
opens the entry the same way and validates it in full before use (Examples.open: schema,
offsets, ids within the vocabulary), so an entry someone else published is only data.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jobgen.base.atomic import fsync_tree
from jobgen.base.owned_dir import OwnedDir, Sharing, UntrustedDirectory
from jobgen.base.safe_read import DamagedFile
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.data import DataSpec
from trainer.data.examples import DataCacheError, Examples
from trainer.data.formats import DataError
from trainer.data.prepare import DONE_DIR
from trainer.data.stats import DataStats, read_stats, write_stats

if TYPE_CHECKING:
    import datasets

log = logging.getLogger("trainer.data.cache")

# Bump when the tokenized output for the same inputs changes (formatting, masking, columns).
CODE_VERSION = 2  # 2: shards of trainer.data.prepare

STAGING_PREFIX = ".tmp-"
STALE_AFTER_S = 3600.0
# A build's shards, kept for the next attempt: a resubmission within days finds them.
SHARDS_PREFIX = ".shards-"
SHARDS_STALE_AFTER_S = 7 * 86400.0
# How long a build whose shard directory another job took waits for that job's entry.
PUBLISH_WAIT_S = 120.0
# In a shard directory: each node's record of the shards it took on (trainer.data.collective).
NODES_DIR = "nodes"
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


def remove_stale_staging(
    root: OwnedDir, *, older_than_s: float = STALE_AFTER_S, shards_older_than_s: float = SHARDS_STALE_AFTER_S
) -> list[str]:
    """Delete the user's staging directories nothing has written to for ``older_than_s``
    (killed builds) and shard directories untouched for ``shards_older_than_s`` (builds nobody
    resubmitted), and anything else at such a name that is no directory (a link: removed as
    itself, never walked). A teammate's staging in a group's cache is theirs to remove."""
    removed = []
    now = time.time()
    me = os.geteuid()
    for name in root.names():
        if name.startswith(SHARDS_PREFIX):
            older_than_s_here = shards_older_than_s
        elif name.startswith(STAGING_PREFIX):
            older_than_s_here = older_than_s
        else:
            continue
        try:
            st = root.lstat(name)
            if st.st_uid != me:
                continue
            if not stat.S_ISDIR(st.st_mode):
                root.unlink(name)
            elif _stale(root, name, now, older_than_s_here):
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


def shards_name(fingerprint: str) -> str:
    """Where the user's build of ``fingerprint`` keeps its shards until the entry is published."""
    return f"{SHARDS_PREFIX}{fingerprint}-{os.geteuid()}"


def _work_dir(root: OwnedDir, name: str) -> OwnedDir:
    """The user's shard directory ``name`` (made, or opened as it was left: its done shards are
    kept); a link, a file or someone else's directory at the name is refused, naming it."""
    try:
        return root.make_subdir(name, 0o700)
    except FileExistsError:
        pass
    try:
        return root.subdir(name, Sharing.PRIVATE)
    except UntrustedDirectory as exc:
        raise DataCacheError(f"{exc} (a data build's shard directory; jobgen writes nothing through it)") from None


def _ensure(directory: OwnedDir, name: str) -> OwnedDir:
    try:
        return directory.make_subdir(name, 0o755)
    except FileExistsError:
        return directory.subdir(name, Sharing.PRIVATE)


def build_entry(
    spec: DataSpec,
    tokenizer,
    root: OwnedDir,
    fingerprint: str,
    inputs: dict,
    raw: datasets.Dataset | None = None,
    *,
    share: tuple[int, int] | None = None,
    publish: bool = True,
) -> None:
    """Tokenize the shards not done yet (with ``share`` = (index, count), a node's share of
    them: every count-th from index) into the user's shard directory for
    ``fingerprint`` and, with ``publish``, publish it as ``<fingerprint>`` (:func:`_publish`):
    DataCacheError if some shard is then still not done (another node's that never finished).

    The shard directory outlives a failed or killed build (shards done are not done again by the
    next one; it is removed after SHARDS_STALE_AFTER_S untouched), except after bad data, which
    changes the fingerprint anyway. Everything is written through the directory's descriptor
    (``OwnedDir.pinned``): a rename or a link put at its name meanwhile cannot send a write, a
    delete or a chmod elsewhere.
    """
    if publish:
        _set_aside(root, fingerprint)  # anything there is not complete: the caller looked
    name = shards_name(fingerprint)
    from trainer.data.build import build_dataset  # imports the tokenizing code: only a build needs it

    with _work_dir(root, name) as work:
        try:
            with _ensure(work, "dataset") as dataset, _ensure(work, DONE_DIR) as done:
                stats = build_dataset(
                    spec,
                    tokenizer,
                    dataset_dir=dataset.pinned(),
                    done_dir=done.pinned(),
                    raw_dir=work.pinned() / f"raw-{socket.gethostname()}-{os.getpid()}",
                    raw=raw,
                    share=share,
                    finish=publish,
                )
        except DataError:
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(root.lstat(name), os.fstat(work.fd)):
                    root.remove_tree(name)  # the data must change, and with it the fingerprint
            raise
        except Exception:
            # Another job building the same entry is publishing it under this one's feet (its
            # finish removed the shard bookkeeping this one was writing): use theirs.
            if not _published_by_another(root, fingerprint, name, work):
                raise
            return
        del raw  # drop the memory maps of a converted source before deleting what they map
        if not publish:
            return
        if stats is None:
            raise DataCacheError(f"{root.path / name}: shards of the data are not done (another node's)")
        extra = {"fingerprint": fingerprint, "source": spec.path, "inputs": inputs}
        _publish(root, work, name, fingerprint, stats, extra)


def _published_by_another(root: OwnedDir, fingerprint: str, name: str, work: OwnedDir) -> bool:
    """Whether the entry is complete, or becomes so within PUBLISH_WAIT_S while another job that
    took this shard directory away (it is no longer at its name) finishes publishing it."""
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while True:
        if (complete := _open_entry(root, fingerprint)) is not None:
            complete.close()
            return True
        if os.fstat(work.fd).st_nlink == 0:
            # Removed, not taken: a publisher renames the directory, a node that met bad data
            # removes it (then this build stops at once, not after PUBLISH_WAIT_S).
            return False
        try:
            ours = os.path.samestat(root.lstat(name), os.fstat(work.fd))
        except FileNotFoundError:
            ours = False
        if ours or time.monotonic() > deadline:
            return False  # nobody took it: this build's own failure
        time.sleep(0.2)


def _publish(root: OwnedDir, work: OwnedDir, name: str, fingerprint: str, stats: DataStats, extra: dict) -> None:
    """Rename the complete shard directory to a staging name of this process's (so no other job
    finishes it too), drop the bookkeeping, write stats.json, fsync, and rename it to
    ``<fingerprint>``; if another job published the same entry first, use theirs."""
    claim = f"{STAGING_PREFIX}{fingerprint[:16]}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        root.rename(name, claim)
    except FileNotFoundError:
        if not _published_by_another(root, fingerprint, name, work):
            raise DataCacheError(
                f"{root.path / name}: another job took the shard directory and did not publish it"
            ) from None
        return
    try:
        if not os.path.samestat(root.lstat(claim), os.fstat(work.fd)):
            raise DataCacheError(f"{root.path / name}: the shard directory was replaced while tokenizing")
        for scratch in [DONE_DIR, NODES_DIR, *(n for n in work.names() if n.startswith("raw-"))]:
            with contextlib.suppress(FileNotFoundError):
                work.remove_tree(scratch)
        here = work.pinned()
        write_stats(here / "stats.json", stats, extra)
        fsync_tree(here)  # the rename must not publish files a node crash could still lose
        # A group's cache: its members read the entry; the user's own: the root already hides it.
        os.fchmod(work.fd, 0o755 if root.sharing is Sharing.GROUP else 0o700)
        try:
            root.rename(claim, fingerprint)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            complete = _open_entry(root, fingerprint)
            if complete is None:
                raise
            complete.close()
            # Another job finished the same entry first: identical content, use theirs.
        else:
            root.fsync()
    finally:
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(root.lstat(claim), os.fstat(work.fd)):
                root.remove_tree(claim)


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
