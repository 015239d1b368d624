"""Where a run's :class:`~jobgen.runs.metrics_summary.MetricsSummary` is kept, and how it is
brought up to date: :func:`summarize` reads it from ``metrics.summary.json`` beside the file (or,
where the run directory is not writable, the user's cache), folds in only the lines appended
since, and writes it back.

The summary is a cache, never the record: it names the file it summarises (device and inode),
the offset it reached and digests of the bytes at the file's start and before that offset, and
starts with a digest of its own content. A summary whose file was replaced, truncated or
rewritten at its start or end, another version's, one cut short, edited or that does not parse
is rebuilt from the file, never trusted. (A hand edit in the middle of metrics.jsonl that keeps
its length, its start and its end is not seen: that is the price of not reading the file.)

Only complete lines are folded into what is kept; a last line without its newline (a write in
flight, or cut by a crash) is folded into the answer only, so the answer always equals a full scan's (:func:`full_scan`,
which tests/unit/test_metrics_summary.py compares it with on random histories).

A summary that cannot be written anywhere costs the next reader a longer read, nothing else.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from jobgen.base.atomic import write_bytes_atomic
from jobgen.base.safe_read import LINES_FILE, DamagedFile, open_regular, parse_json, read_bytes
from jobgen.runs.metrics_summary import DamagedSummary, MetricsSummary, summarize_text

# Bytes of the file hashed at its start and before the summary's offset, to know it is the same file.
FINGERPRINT = 4096
CHUNK = 8 << 20


def summary_path(metrics: Path) -> Path:
    """Where the summary of ``metrics`` is kept beside it."""
    return metrics.with_name(metrics.stem + ".summary.json")


def _cache_path(metrics: Path) -> Path:
    """The user's copy, for a run directory this user cannot write to."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(str(metrics.absolute()).encode()).hexdigest()[:32]
    return base / "jobgen" / "metrics-summaries" / f"{digest}.json"


def _fingerprint(fd: int, offset: int) -> dict[str, Any]:
    st = os.fstat(fd)
    head = os.pread(fd, min(FINGERPRINT, offset), 0)
    start = max(0, offset - FINGERPRINT)
    before = os.pread(fd, offset - start, start)
    return {
        "device": st.st_dev,
        "inode": st.st_ino,
        "offset": offset,
        "head": hashlib.sha256(head).hexdigest(),
        "before_offset": hashlib.sha256(before).hexdigest(),
    }


def _stored(path: Path, fd: int, size: int) -> tuple[MetricsSummary, int] | None:
    """The kept summary of the file open at ``fd`` and the offset it reached, if one is kept
    and is of this very file as it is now; None otherwise (then it is rebuilt)."""
    for candidate in (summary_path(path), _cache_path(path)):
        try:
            state, series = _checked(read_bytes(candidate))
            data = parse_json(candidate, state)
            mark = data["file"]
            offset = mark["offset"]
            if not isinstance(offset, int) or not 0 <= offset <= size or _fingerprint(fd, offset) != mark:
                continue
            return MetricsSummary.from_json(path, data, series), offset
        except (OSError, DamagedFile, DamagedSummary, KeyError, TypeError):
            continue
    return None


def _checked(content: bytes) -> tuple[bytes, bytes]:
    """The summary's two lines (its state, then its series), after the digest of both that
    starts the file: a summary cut short or edited is not the one written, and DamagedSummary
    says so."""
    digest, _, body = content.partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise DamagedSummary("its digest does not match its content")
    state, _, series = body.partition(b"\n")
    return state, series


def _keep(path: Path, summary: MetricsSummary, fd: int, offset: int) -> None:
    """Write the summary beside the file, else into the user's cache; a summary that cannot be
    written anywhere costs the next reader a longer read, nothing else."""
    state = json.dumps({**summary.to_json(), "file": _fingerprint(fd, offset)}, separators=(",", ":"))
    body = (state + "\n" + json.dumps(summary.series_json(), separators=(",", ":"))).encode()
    data = hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    for candidate in (summary_path(path), _cache_path(path)):
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(candidate, data)
            return
        except OSError:
            continue


def summarize(path: Path, *, keep: bool = True) -> MetricsSummary:
    """The summary of the metrics file at ``path`` as it is now: the kept one brought up to date
    with the lines appended since, or a new one. ``keep`` writes it back for the next reader."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return MetricsSummary(path)
    except DamagedFile as exc:
        out = MetricsSummary(path)
        out.unreadable = exc.problem
        return out
    try:
        size = os.fstat(fd).st_size
        if size > LINES_FILE:
            out = MetricsSummary(path)
            out.unreadable = f"is larger than {LINES_FILE >> 20} MiB, more than any such file jobgen writes"
            return out
        found = _stored(path, fd, size)
        summary, offset = found if found is not None else (MetricsSummary(path), 0)
        start = offset
        offset, tail = _fold(summary, fd, offset, size)
        if keep and (offset != start or found is None):
            _keep(path, summary, fd, offset)
    except OSError as exc:
        out = MetricsSummary(path)
        out.unreadable = f"cannot read it: {exc.strerror or exc}"
        return out
    finally:
        os.close(fd)
    if tail:  # a last line without its newline: part of the answer, not of what is kept
        summary = copy.deepcopy(summary)
        summary.add_line(tail)
    return summary


def _fold(summary: MetricsSummary, fd: int, offset: int, size: int) -> tuple[int, bytes]:
    """Fold the complete lines of ``[offset, size)``; the offset after the last of them, and
    the bytes after it (a line not yet ended)."""
    rest = b""
    position = offset
    while position < size:
        chunk = os.pread(fd, min(CHUNK, size - position), position)
        if not chunk:
            break
        position += len(chunk)
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            summary.add_line(line)
        offset = position - len(rest)
    return offset, rest


def full_scan(path: Path) -> MetricsSummary:
    """The summary built from the whole file, nothing kept or reused: what :func:`summarize`
    must always equal."""
    return summarize_text(path, path.read_bytes() if path.is_file() else b"")
