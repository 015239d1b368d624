"""Fuzz tests of two readers of files others may write (issue 45): metrics.jsonl's kept summary
(jobgen/runs/summary_cache.py with MetricsSummary.from_json) and a launch's heartbeat directory
as the batch script's watcher reads it (jobgen.runs.heartbeat.newest_step). The cache entry
and the snapshot reader have theirs (test_fuzz_cache_entry.py, test_fuzz_snapshots.py).

Seeded (``SEED``; ``JOBGEN_FUZZ_SEED`` for another) and bounded by a count of cases and a time
budget (``JOBGEN_FUZZ_SECONDS`` runs longer and lifts the count). Each case runs in a forked
child under a time and address-space limit (tests/bounded.py):

- a summary: random JSON mutations of the valid summary's two lines (values replaced by random
  JSON of any type, keys removed or added, lists cut or grown, numbers at the edges), its digest
  written again as jobgen writes it (the digest is no secret). Whatever the summary holds, the
  summary read equals the one rebuilt from metrics.jsonl, or is the kept one unchanged: what
  the read-side commands answer never depends on a damaged summary, and nothing escapes;
- a heartbeat directory: random regular files (random bytes and sizes, other owners), FIFOs,
  links, directories at ``rank-*`` names. ``newest_step`` answers the newest step of the user's
  own regular files that hold one, computed here independently, and never waits on a FIFO or
  reads through a link.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from bounded import bounded
from jobgen.runs.heartbeat import MOST_BYTES, newest_step
from jobgen.runs.summary_cache import full_scan, summarize, summary_path

pytestmark = pytest.mark.timeout(120)

SEED = int(os.environ.get("JOBGEN_FUZZ_SEED", "45"))
SECONDS = float(os.environ.get("JOBGEN_FUZZ_SECONDS", "6"))
CASES = None if "JOBGEN_FUZZ_SECONDS" in os.environ else 150
T0 = 1_780_000_000.25
OTHER_UID = 54321


def budget() -> Any:
    """Case numbers until the count or the time is spent, whichever first."""
    deadline = time.monotonic() + SECONDS
    number = 0
    while (CASES is None or number < CASES) and time.monotonic() < deadline:
        yield number
        number += 1


# ---------------------------------------------------------------- summaries


def metrics_text() -> str:
    lines = []
    for step in range(1, 40):
        job = "17" if step < 25 else "18"
        lines.append({"time": T0 + step, "job_id": job, "restart": 0 if job == "17" else 1, "step": step,
                      "loss": 3.0 - step / 20, "lr": 1e-4, "tokens_per_s": 900.5, "step_seconds": 1.25})  # fmt: skip
        if step % 10 == 0:
            lines.append({"time": T0 + step, "job_id": job, "restart": 0, "step": step, "event": "eval",
                          "eval_loss": 2.5 - step / 100, "eval_ppl": 12.0})  # fmt: skip
    return "".join(json.dumps(line) + "\n" for line in lines)


EDGES = (None, True, False, 0, -1, 1.5, 2**63, -(2**63) - 1, 10**30, "", "x", "\x1b[2J", [], {}, [1, "a"], {"a": 1})


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 2 else 5)
    if kind == 0:
        return rng.choice(EDGES)
    if kind == 1:
        return rng.randint(-(2**70), 2**70)
    if kind == 2:
        return rng.choice([rng.random() * 10 ** rng.randint(-5, 300), float("inf"), float("nan"), -0.0])
    if kind == 3:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(6)))
    if kind == 4:
        return rng.randrange(-3, 100)
    if kind in (5, 6):
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(rng.randrange(10)): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def mutate(value: Any, rng: random.Random) -> Any:
    """``value`` with one random change somewhere inside it."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(sorted(value, key=str))
        copy = dict(value)
        action = rng.random()
        if action < 0.15:
            del copy[key]
        elif action < 0.25:
            copy[rng.choice(["extra", "step", "tasks", "0"])] = random_json(rng)
        else:
            copy[key] = mutate(value[key], rng)
        return copy
    if isinstance(value, list) and value and rng.random() < 0.8:
        copy = list(value)
        action = rng.random()
        if action < 0.15:
            del copy[rng.randrange(len(copy)) :]
        elif action < 0.25:
            copy.append(random_json(rng))
        else:
            index = rng.randrange(len(copy))
            copy[index] = mutate(copy[index], rng)
        return copy
    return random_json(rng)


def answers(summary: Any) -> Any:
    """What the read-side commands take from a summary: its state as it would be kept."""
    return json.dumps(summary.to_json(), sort_keys=True, default=repr)


def consumed(metrics: Path) -> str:
    """The summary as every reader of it uses it (status, goodput, plot, compare, the watchdogs):
    an exception in any of them is a crash of that command."""
    found = summarize(metrics, keep=False)
    found.warning()
    found.eta_step_seconds()
    found.last_training_line_of_job("17")
    for key in ("loss", "lr", "eval_loss", "tokens_per_s"):
        found.segments(key)
        found.curve(key)
    list(found.recent)
    json.dumps(found.series_json(), allow_nan=True)
    return answers(found)


def test_a_summary_fuzzed_under_a_valid_digest_is_rebuilt_or_read_without_a_crash(tmp_path: Path):
    """A summary whose values are of the types jobgen writes may be taken as kept (the digest
    is no secret, and whoever can write it can rewrite metrics.jsonl as well); any other is
    rebuilt; no reader of it crashes, hangs or allocates what it says."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics_text())
    valid = answers(summarize(metrics))  # kept beside it
    assert valid == answers(full_scan(metrics))
    kept = summary_path(metrics).read_bytes()
    _, _, body = kept.partition(b"\n")
    state_line, _, series_line = body.partition(b"\n")
    state, series = json.loads(state_line), json.loads(series_line)
    rng = random.Random(SEED)
    failures = []
    changed = 0
    for number in budget():
        for _ in range(rng.randrange(1, 4)):
            if rng.random() < 0.7:
                state = json.loads(state_line) if number and rng.random() < 0.1 else state
                state = mutate(state, rng)
            else:
                series = mutate(series, rng)
        new_body = json.dumps(state, separators=(",", ":")).encode() + b"\n" + json.dumps(series).encode()
        summary_path(metrics).write_bytes(hashlib.sha256(new_body).hexdigest().encode() + b"\n" + new_body)

        outcome = bounded(lambda: consumed(metrics), seconds=20, extra_bytes=512 << 20)
        if not outcome.returned:
            failures.append((number, outcome.error_type, outcome.hung, outcome.signal, outcome.traceback[-1500:]))
        elif outcome.value != repr(valid):
            changed += 1  # type-correct, and so taken as kept (whoever writes it could rewrite metrics.jsonl)
        state, series = json.loads(state_line), json.loads(series_line)
    assert not failures, failures[:3]
    assert changed < number, "every damaged summary was taken: the digest alone decides"


# ---------------------------------------------------------------- heartbeat directories


def plant(directory: Path, rng: random.Random, me_only: bool) -> int | None:
    """Random things at ``rank-*`` names; the newest step the user's own regular files hold."""
    newest = None
    for rank in range(rng.randrange(1, 8)):
        path = directory / f"rank-{rank}"
        kind = rng.randrange(7)
        if kind <= 2:  # a rank's file, maybe damaged
            step = rng.randrange(0, 10**6)
            text = rng.choice([f"{step}\n", f"{step}", "\n", f" {step} \n", "x\n", "7" * rng.randrange(20, 80), ""])
            if rng.random() < 0.2:
                text = bytes(rng.randrange(256) for _ in range(rng.randrange(64))).decode("latin-1")
            path.write_bytes(text.encode("latin-1"))
            words = text.encode("latin-1").strip()
            mine = me_only or rng.random() < 0.7
            if not mine:
                os.chown(path, OTHER_UID, -1)
            if mine and len(text.encode("latin-1")) <= MOST_BYTES and words.isdigit():
                newest = max(newest or 0, int(words))
        elif kind == 3:
            os.mkfifo(path)
        elif kind == 4:
            target = directory.parent / f"elsewhere-{rank}"
            target.write_text(f"{10**7 + rank}\n")  # a step no rank of this directory wrote
            os.symlink(target, path)
        elif kind == 5:
            path.mkdir()
        else:
            os.symlink("/dev/zero", path)
    return newest


def test_a_heartbeat_directory_fuzzed_is_read_for_the_users_own_steps_only(tmp_path: Path):
    rng = random.Random(SEED)
    me_only = os.geteuid() != 0  # chown to another user needs root
    failures = []
    for number in budget():
        directory = tmp_path / f"case-{number}" / "beats"
        directory.mkdir(parents=True, mode=0o755)
        os.chmod(directory, 0o755)
        expected = plant(directory, rng, me_only)
        outcome = bounded(lambda directory=directory: newest_step(directory), seconds=10, extra_bytes=256 << 20)
        if outcome.value != repr(expected):
            failures.append((number, sorted(p.name for p in directory.iterdir()), expected, outcome))
        for path in directory.iterdir():
            st = path.lstat()
            assert not (stat.S_ISREG(st.st_mode) and st.st_size > 1 << 20)
    assert not failures, failures[:3]
