"""metrics.jsonl's kept summary (``metrics.summary.json``, jobgen/runs/summary_cache.py) with a
valid digest and a value of the wrong type or out of range anywhere in it (issue 45).

The digest at the summary's start is no secret: whoever can write the run directory (a
teammate, a program of theirs) can write a summary whose digest matches and whose values are
anything JSON holds. So the digest proves only that the summary is not cut short or edited by
accident; MetricsSummary.from_json (and TaskMetrics's, Decimated's) checks the type and the
range of every value the read-side commands compute with, and a summary that fails is rebuilt
from metrics.jsonl, as one cut short is.

The valid summary is the one jobgen writes for a small metrics.jsonl (two tasks, evaluations,
a line that is no record, a last line that is no JSON). Each case replaces one key path's value
of the summary's state or of its series (tests/damage.py's WRONG_VALUES, its numbers no reader
can compute with, a string of terminal escapes, the key removed) and writes the digest again as
summary_cache writes it. A case is *wrong* when the value is surely not what jobgen writes there
(:func:`surely_wrong`, which knows the summary's shape, not the checks of the code): then the
summary read must equal the valid one (rebuilt), and so must every answer status, goodput, the
watchdogs, plot and compare take from it. Every case, wrong or not: no exception escapes. The
same with a line appended to metrics.jsonl after the damage (the kept summary is read, then
folded on). A sample of the cases also goes through ``jobgen status RUN`` (text and --json)
and the runs listing, whose output must be the valid one's for a wrong case and never a
traceback.

Seeded and bounded: every case of the summary's fields (a key path of at most two keys:
``state.tasks``, ``file.inode``, ``loss.width``), and SEED's sample of the items below them
(CASES_PER_PATH wrong values of each key path, and one other); CLI_CASES of the wrong ones go
through the commands. JOBGEN_DAMAGE_CASES=all takes every case.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from damage import HOSTILE, HUGE_INT, RAW_TOKENS, WRONG_VALUES, _marker, _replaced, dump, key_paths
from damaged_world import slurm_answers_nothing
from jobgen.base.safe_read import LARGEST_ID, LATEST_TIME
from jobgen.report.status import eval_progress
from jobgen.runs.jsonl_records import METRICS_FIELDS
from jobgen.runs.metrics_summary import PLOTTED, MetricsSummary
from jobgen.runs.rundir import RunDir
from jobgen.runs.summary_cache import full_scan, summarize, summary_path
from run_dirs import training_run_at_step_25

SEED = 45
CASES_PER_PATH = 3  # wrong values of each key path below a field, and one value that may be right
CLI_CASES = 40  # of those, through `jobgen status RUN`, `--json` and the listing
T0 = 1_780_000_000.25  # a float: a time is told from the other numbers by its size
JOBS = (17, 18)


def every_case() -> bool:
    return os.environ.get("JOBGEN_DAMAGE_CASES", "") == "all"


# ---------------------------------------------------------------- the valid files


def metrics_text() -> bytes:
    """Two tasks (the second a relaunch of a requeued job), an evaluation each, a line that is
    no record, and a last line that is no JSON (pending: a write cut by a crash, until a line
    follows). No value is null: where the summary holds a null, only a nullable field does."""
    lines: list[dict[str, Any]] = []
    for step in (5, 10, 15):
        lines.append({"time": T0 + step, "job_id": "17", "restart": 0, "step": step, "loss": 3.0 - step / 10,
                      "lr": 1e-4, "tokens_per_s": 900.5, "step_seconds": 1.25 + step / 100,
                      "host_used_percent": 40.5})  # fmt: skip
    lines.append({"time": T0 + 16, "job_id": "17", "restart": 0, "step": 15, "event": "eval", "eval_loss": 2.25,
                  "eval_ppl": 9.5})  # fmt: skip
    for step in (15, 20):
        lines.append({"time": T0 + 100 + step, "job_id": "18", "restart": 1, "launch": 1, "step": step,
                      "loss": 2.0 - step / 100, "tokens_per_s": 410.5, "step_seconds": 2.5,
                      "host_used_percent": 60.5})  # fmt: skip
    lines.append({"time": T0 + 121, "job_id": "18", "restart": 1, "launch": 1, "step": 20, "event": "eval",
                  "eval_loss": 2.5, "eval_ppl": 12.25})  # fmt: skip
    text = [json.dumps(line) for line in lines]
    text.insert(1, '{"time": 1780000000, "step": "seven"}')
    return ("\n".join(text) + "\ngarbage\n").encode()


APPENDED = json.dumps({"time": T0 + 130, "job_id": "18", "restart": 1, "launch": 1, "step": 25, "loss": 1.5}) + "\n"


def tasks_text() -> bytes:
    """Job 17 started and exited; job 18's relaunch started and left no exit (killed): its
    report comes from the summary's TaskMetrics."""
    first = {"event": "first_step", "array_job_id": "17", "array_task": "1", "world_size": 1}
    records = [
        {**first, "time": T0 + 4, "job_id": "17", "restart": 0, "start_step": 0, "job_start": T0 - 10},
        {"time": T0 + 20, "event": "exit", "job_id": "17", "restart": 0, "start_step": 0, "end_step": 15,
         "exit_code": 0, "job_start": T0 - 10, "step_seconds_total": 4.0},
        {**first, "time": T0 + 110, "job_id": "18", "restart": 1, "launch": 1, "start_step": 10,
         "job_start": T0 + 90},
    ]  # fmt: skip
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def kept_parts(path: Path) -> tuple[Any, Any]:
    """The state and the series of the summary kept beside ``path``, as JSON."""
    _, _, body = summary_path(path).read_bytes().partition(b"\n")
    state, _, series = body.partition(b"\n")
    return json.loads(state), json.loads(series)


def with_digest(state: bytes, series: bytes) -> bytes:
    """A summary file as summary_cache._keep writes one: the digest of its two lines, then them."""
    body = state + b"\n" + series
    return hashlib.sha256(body).hexdigest().encode() + b"\n" + body


# ---------------------------------------------------------------- the cases

REMOVED = object()
UNPARSEABLE = object()  # an integer of 5000 digits: no JSON parser of Python's reads it
PARSED = {
    HUGE_INT: 10**400,
    "-" + HUGE_INT: -(10**400),
    "9" * 5000: UNPARSEABLE,
    "1e308": 1e308,
    "1e400": math.inf,
    "-1e400": -math.inf,
    "NaN": math.nan,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
}
NEW_VALUES = (*WRONG_VALUES, *(_marker(t) for t in RAW_TOKENS), HOSTILE, REMOVED)


@dataclass(frozen=True)
class Case:
    line: str  # "state" (with the version and the file's fingerprint) or "series"
    path: tuple
    new: Any
    wrong: bool

    def __str__(self) -> str:
        shown = "removed" if self.new is REMOVED else repr(self.new)[:40]
        return f"{self.line}: {'.'.join(map(str, self.path))} = {shown}{' (wrong)' if self.wrong else ''}"

    def content(self, state: Any, series: Any) -> bytes:
        damaged = _replaced(state if self.line == "state" else series, self.path, self.new, self.new is REMOVED)
        if self.line == "state":
            return with_digest(dump(damaged), dump(series))
        return with_digest(dump(state), dump(damaged))


def nullable(line: str, path: tuple) -> bool:
    """Whether the summary may hold null at ``path``: what jobgen writes where a run has not
    logged it yet (no evaluation, no step time, no memory figure)."""
    if line != "state" or len(path) < 2 or path[0] != "state":
        return False
    path = path[1:]
    if path in {("pending",), ("last_training",), ("last_loss",), ("eval_last",), ("eval_lowest",)}:
        return True
    if path[0] == "eta_seconds" or path[1:] == ("eval_ppl",):
        return True
    if path[0] == "last_training":  # a record's optional fields
        return path[1] not in METRICS_FIELDS[0]
    # a task's metrics: [last_time, last_train, lines, max_step, max_time, seconds_count, seconds_max, seconds_sum]
    return path[0] == "tasks" and path[2:] in {(3, 1), (3, 6), (3, 1, 1)}


def _number(value: Any) -> bool:
    return type(value) is float or (type(value) is int and abs(value) <= LARGEST_ID)


def surely_wrong(line: str, path: tuple, parent: Any, new: Any) -> bool:
    """Whether ``new`` at ``path`` is surely not what jobgen writes there (the valid summary's
    value there, in ``parent``, tells the kind of the field): then it must be rebuilt. False
    where it may be right: a count of 0, a loss of NaN, another string, a list of another length."""
    valid = parent[path[-1]]
    if new is UNPARSEABLE:
        return True
    if line == "state" and path[0] in ("version", "file"):  # the summary's identity: any change
        return True
    if new is REMOVED:
        in_record = len(path) == 3 and path[:2] == ("state", "last_training")
        return isinstance(parent, dict) and not (in_record and path[2] not in METRICS_FIELDS[0])
    if new is None:
        return not nullable(line, path)
    if type(valid) is float and valid > 1e9:  # a time: a date is made of it
        return not (_number(new) and math.isfinite(new) and 0 <= new <= LATEST_TIME)
    if path[-1] == "job_id":  # a record's job id: a string or an integer
        return not (type(new) is str or (type(new) is int and abs(new) <= LARGEST_ID))
    if type(valid) is float:
        return not _number(new)
    if type(valid) is int:
        return not (type(new) is int and abs(new) <= LARGEST_ID)
    return type(new) is not type(valid)


def _parent(root: Any, path: tuple) -> Any:
    for key in path[:-1]:
        root = root[key]
    return root


def cases(state: Any, series: Any) -> list[Case]:
    """Every case, or every case of the fields and SEED's sample of the items below them."""
    rng = random.Random(SEED)
    out: list[Case] = []
    for line, valid in (("state", state), ("series", series)):
        for path in key_paths(valid):
            parent = _parent(valid, path)
            made = [Case(line, path, new, surely_wrong(line, path, parent, _parsed(new))) for new in NEW_VALUES]
            wrong, other = [c for c in made if c.wrong], [c for c in made if not c.wrong]
            if len(path) > 2 and not every_case():
                wrong, other = rng.sample(wrong, min(CASES_PER_PATH, len(wrong))), rng.sample(other, min(1, len(other)))
            out += wrong + other
    return out


def _parsed(new: Any) -> Any:
    if isinstance(new, str) and new.startswith("@@raw:"):
        return PARSED[new.removeprefix("@@raw:").removesuffix("@@")]
    return new


# ---------------------------------------------------------------- what the readers take from it


def whole(summary: MetricsSummary) -> str:
    """Everything a summary keeps, its state and its series, as text (NaN equal to NaN)."""
    return json.dumps({**summary.to_json(), "series": summary.series_json()}, sort_keys=True)


def answers(summary: MetricsSummary) -> str:
    """What status, goodput, the watchdogs, plot and compare compute from a summary."""
    last = summary.last_training or {}
    out = {
        "warning": summary.warning(),
        "status": [last.get("step"), last.get("loss"), last.get("tokens_per_s"), summary.eta_step_seconds()],
        "eval": eval_progress(summary, None),
        "records": [summary.records, summary.has_loss, list(summary.recent)],
        "killed": [
            [*key, t.max_step, t.max_time, t.last_time, t.seconds_max, t.mean_step_seconds]
            for key, t in summary.tasks.items()
        ],
        "memory": [summary.last_training_line_of_job(job) for job in JOBS],
        "plot": {key: summary.segments(key) for key in PLOTTED},
        "compare": [summary.last_loss, summary.curve("loss"), summary.curve("eval_loss")],
    }
    return json.dumps(out, sort_keys=True)


@dataclass
class Valid:
    metrics: Path
    state: Any
    series: Any
    whole: str
    answers: str
    appended_whole: str
    appended_answers: str


@pytest.fixture
def valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Valid:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no user's copy of the summary read
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(metrics_text() + APPENDED.encode())
    appended = full_scan(path)
    path.write_bytes(metrics_text())
    kept = summarize(path)
    state, series = kept_parts(path)
    assert state["state"]["pending"] and state["state"]["skipped"] == 1 and len(state["state"]["tasks"]) == 2
    assert whole(kept) == whole(full_scan(path)) == whole(summarize(path))  # read back as it was written
    return Valid(path, state, series, whole(kept), answers(kept), whole(appended), answers(appended))


def read_damaged(valid: Valid, case: Case) -> Iterator[str]:
    """What is wrong with how the summary with ``case``'s damage is read, then folded on."""
    path = valid.metrics
    path.write_bytes(metrics_text())  # the same inode: the summary's fingerprint still matches
    valid_answers = {False: (valid.whole, valid.answers), True: (valid.appended_whole, valid.appended_answers)}
    for appended, expected in valid_answers.items():
        summary_path(path).write_bytes(case.content(valid.state, valid.series))
        if appended:
            with open(path, "a") as fh:
                fh.write(APPENDED)
        try:
            got = (whole(summary := summarize(path)), answers(summary))
        except Exception as exc:  # noqa: BLE001 - what escapes is the finding
            yield f"{case}{' then a line appended' if appended else ''}: {type(exc).__name__}: {exc}"
            continue
        if case.wrong and got != expected:
            yield f"{case}{' then a line appended' if appended else ''}: not rebuilt, the summary differs"


def test_a_summary_with_a_valid_digest_and_a_wrong_value_is_rebuilt(valid: Valid):
    chosen = cases(valid.state, valid.series)
    assert sum(c.wrong for c in chosen) > 300 and {c.line for c in chosen} == {"state", "series"}
    found = [problem for case in chosen for problem in read_damaged(valid, case)]
    assert not found, f"{len(found)} finding(s) in {len(chosen)} case(s):\n" + "\n".join(found)


def test_the_valid_summary_is_read_as_kept_never_rebuilt(valid: Valid, monkeypatch: pytest.MonkeyPatch):
    """The checks refuse nothing jobgen writes: the kept summary is used as it is (not written
    again), its series parsed, not folded again from the file."""
    kept = summary_path(valid.metrics)
    before = (kept.stat().st_ino, kept.read_bytes())

    def folded_again(path):
        raise AssertionError(f"the valid series was folded again from {path}")

    monkeypatch.setattr("jobgen.runs.metrics_summary.open_regular", folded_again, raising=False)
    summary = summarize(valid.metrics)
    assert whole(summary) == valid.whole and answers(summary) == valid.answers
    assert (kept.stat().st_ino, kept.read_bytes()) == before


def test_a_damaged_series_of_a_file_changed_since_is_left_empty(valid: Valid):
    """The series is parsed only when asked for (a plot, a line to fold in): damaged then, it
    is folded again from the lines the kept state covers, and left empty where the file no
    longer starts with them (rewritten since the summary was read), never another file's."""
    state = dump(valid.state)
    damaged = dump(_replaced(valid.series, ("loss", "buckets", 0, 2, 0, 2), "text"))
    summary = MetricsSummary.from_json(valid.metrics, json.loads(state), damaged)
    assert whole(summary) == valid.whole  # folded again from the file, which has not changed
    summary = MetricsSummary.from_json(valid.metrics, json.loads(state), damaged)
    valid.metrics.write_bytes(metrics_text().replace(b'"job_id": "18"', b'"job_id": "19"'))
    assert summary.series_json() == {key: {"width": 1, "buckets": []} for key in PLOTTED}
    assert summary.segments("loss") == [] and summary.curve("eval_loss") == []


# ---------------------------------------------------------------- through the commands


@dataclass
class Commands:
    run: RunDir
    valid: dict[str, str]
    state: Any
    series: Any


def invoke(args: list[str]) -> tuple[int, str, str | None]:
    from jobgen.cli.main import main

    result = CliRunner().invoke(main, args, catch_exceptions=True)
    crash = None
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        crash = f"{type(result.exception).__name__}: {result.exception}"
    return result.exit_code, result.stdout + result.stderr, crash


COMMANDS = {"status RUN": ["status", "{run}"], "status RUN --json": ["status", "{run}", "--json"],
            "the listing": ["status"], "the listing --json": ["status", "--json"]}  # fmt: skip


def run_all(run: RunDir) -> dict[str, tuple[int, str, str | None]]:
    return {name: invoke([a.format(run=run.path) for a in args]) for name, args in COMMANDS.items()}


@pytest.fixture
def commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Commands]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("time.time", lambda: T0 + 600)  # killed tasks' allocations are counted to now
    run = training_run_at_step_25(tmp_path)
    run.metrics.write_bytes(metrics_text())
    (run.path / "tasks.jsonl").write_bytes(tasks_text())
    monkeypatch.setenv("JOBGEN_RUNS_ROOT", str(run.path.parent))
    with slurm_answers_nothing():
        summarize(run.metrics)
        state, series = kept_parts(run.metrics)
        outcomes = run_all(run)
        assert all(code == 0 and crash is None for code, _, crash in outcomes.values()), outcomes
        shown = json.loads(outcomes["status RUN --json"][1])
        assert shown["eta_seconds"] and shown["eval_last"] and shown["goodput"], shown  # what the summary gives
        yield Commands(run, {name: out for name, (_, out, _) in outcomes.items()}, state, series)


# The two damages issue 45 reported, then a sample of the wrong cases.
REPORTED = (
    Case("state", ("state", "eta_seconds"), ["abc"], True),
    Case("state", ("state", "last_training"), "x", True),
)


def test_status_and_the_listing_answer_as_on_the_valid_summary(commands: Commands):
    wrong = [c for c in cases(commands.state, commands.series) if c.wrong]
    chosen = [*REPORTED, *(wrong if every_case() else random.Random(SEED).sample(wrong, CLI_CASES))]
    found = []
    with slurm_answers_nothing():
        for case in chosen:
            commands.run.metrics.write_bytes(metrics_text())
            for name, (code, out, crash) in run_all_damaged(commands, case).items():
                if crash or "Traceback" in out or code != 0:
                    found.append(f"{case}, {name}: exit {code}, {crash or out[-300:]}")
                elif out != commands.valid[name]:
                    found.append(f"{case}, {name}: not the valid summary's answer: {out[-300:]!r}")
    assert not found, f"{len(found)} finding(s):\n" + "\n".join(found)


def run_all_damaged(commands: Commands, case: Case) -> dict[str, tuple[int, str, str | None]]:
    out = {}
    for name, args in COMMANDS.items():  # each command finds the damaged summary (none rebuilds it for the next)
        summary_path(commands.run.metrics).write_bytes(case.content(commands.state, commands.series))
        out[name] = invoke([a.format(run=commands.run.path) for a in args])
    return out
