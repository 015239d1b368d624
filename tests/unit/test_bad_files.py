"""Run-directory records that are readable JSON but not what jobgen wrote: the tools name the
file and what is wrong, and show the rest; none of them prints a traceback.

``quarantine.json`` is checked as a whole (jobgen.quarantine.read, QuarantineError); the lines
of ``metrics.jsonl`` and ``tasks.jsonl`` one by one (jobgen.goodput.read_records), a bad line
skipped and counted. No Slurm: the run has no submissions, so status asks Slurm nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import jobgen

# Each is valid JSON (1e400 parses as infinity) and no record of its file.
BAD_QUARANTINE = {
    "a list": ("[]", "Input should be an object"),
    "nodes a list": ('{"nodes": []}', "nodes: Input should be an object"),
    "extra key": ('{"nodes": {}, "note": "x"}', "note: Extra inputs are not permitted"),
    "since a string": ('{"nodes": {"n1": {"since": "x", "job": "7", "reason": "r"}}}', "nodes.n1.since"),
    "since 1e400": ('{"nodes": {"n1": {"since": 1e400, "job": "7", "reason": "r"}}}', "finite number"),
    "not JSON": ('{"nodes": ', "Invalid JSON"),
}

BAD_LINES = {
    "a list": ("[1, 2, 3]", "a JSON list, not an object"),
    "a string": ('"str"', "a JSON str, not an object"),
    "step a string": ('{"time": 5.0, "step": "abc"}', "'step' is 'abc', not an integer"),
    "time 1e400": ('{"time": 1e400, "step": 3}', "'time' is inf, not a time (seconds since 1970)"),
    "no time": ('{"step": 3}', "no 'time'"),
}

GOOD_METRICS = [
    {"time": 1000.0 + s, "job_id": "7", "restart": 0, "step": s, "loss": 2.0 / s, "lr": 1e-4, "tokens_per_s": 50.0}
    for s in (1, 2, 3)
] + [{"time": 1004.0, "job_id": "7", "restart": 0, "step": 3, "event": "eval", "eval_loss": 1.5}]
GOOD_TASKS = [
    {"time": 1001.0, "job_id": "7", "restart": 0, "event": "first_step", "step": 1, "start_step": 0,
     "job_start": 990.0, "seconds_to_first_step": 11.0},
    {"time": 1010.0, "job_id": "7", "restart": 0, "event": "exit", "start_step": 0, "end_step": 3,
     "job_start": 990.0, "step_seconds_total": 3.0, "step_seconds_max": 1.0, "save_seconds": [0.5],
     "exit_code": 0, "exit_reason": "done"},
]  # fmt: skip


def _write_lines(path: Path, records: list[dict], bad: str) -> None:
    """The good records with the bad line in the middle, and a last line cut by a crash
    (tolerated silently, as before)."""
    lines = [json.dumps(r) for r in records]
    lines.insert(1, bad)
    path.write_text("\n".join(lines) + '\n{"time": 10')


def _assert_clean(proc, code: int = 0) -> None:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == code, out


@pytest.mark.parametrize("text, problem", list(BAD_QUARANTINE.values()), ids=list(BAD_QUARANTINE))
def test_corrupt_quarantine_is_a_warning_in_status(run, text, problem):
    run.quarantine.write_text(text)
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD_METRICS))

    proc = jobgen("status", str(run.path))
    _assert_clean(proc)
    assert str(run.quarantine) in proc.stdout and problem in proc.stdout, proc.stdout

    proc = jobgen("status", str(run.path), "--json")
    _assert_clean(proc)
    view = json.loads(proc.stdout)
    warnings = [w for w in view["warnings"] if str(run.quarantine) in w]
    assert len(warnings) == 1 and problem in warnings[0], view["warnings"]
    assert view["quarantined"] == [] and view["step"] == 3, view  # the rest is still shown


@pytest.mark.parametrize("text, problem", list(BAD_QUARANTINE.values()), ids=list(BAD_QUARANTINE))
def test_corrupt_quarantine_refuses_submit_with_one_line(run, text, problem):
    run.quarantine.write_text(text)
    spec = run.path.parent.parent / "run.toml"  # the fixture's spec file (runs_root = "runs")

    proc = jobgen("submit", str(spec), "--dry-run")
    _assert_clean(proc, 2)
    errors = [line for line in proc.stderr.splitlines() if str(run.quarantine) in line]
    assert len(errors) == 1 and problem in errors[0] and errors[0].strip().startswith("error:"), proc.stderr


@pytest.mark.parametrize("name", ["metrics.jsonl", "tasks.jsonl"])
@pytest.mark.parametrize("bad, problem", list(BAD_LINES.values()), ids=list(BAD_LINES))
def test_bad_jsonl_lines_are_skipped_and_counted(run, name, bad, problem):
    metrics, tasks = run.path / "metrics.jsonl", run.path / "tasks.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in GOOD_METRICS))
    tasks.write_text("".join(json.dumps(r) + "\n" for r in GOOD_TASKS))
    path = run.path / name
    _write_lines(path, GOOD_METRICS if name == "metrics.jsonl" else GOOD_TASKS, bad)
    expected = f"{path}: skipped 1 line(s) that are not "

    proc = jobgen("status", str(run.path))
    _assert_clean(proc)
    shown = [line for line in proc.stdout.splitlines() if expected in line]
    assert len(shown) == 1 and f"line 2: {problem}" in shown[0], proc.stdout

    proc = jobgen("status", str(run.path), "--json")
    _assert_clean(proc)
    view = json.loads(proc.stdout)
    assert [w for w in view["warnings"] if w.startswith(expected)], view["warnings"]
    assert view["step"] == 3 and view["eval_last"]["eval_loss"] == 1.5, view  # the good lines count

    out = run.path / "progress.png"
    proc = jobgen("plot", str(run.path), "-o", str(out))
    _assert_clean(proc)
    assert out.stat().st_size > 0
    warned = [line for line in proc.stderr.splitlines() if expected in line]
    assert len(warned) == 1 and problem in warned[0], proc.stderr


def test_reader_keeps_every_record_and_only_counts_bad_lines(tmp_path):
    from jobgen.goodput import read_metrics, read_tasks

    path = tmp_path / "metrics.jsonl"
    _write_lines(path, GOOD_METRICS, "[1, 2, 3]")
    records = read_metrics(path)
    assert list(records) == GOOD_METRICS and records.skipped == 1
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD_METRICS) + '{"cut')  # a crash mid-write
    records = read_metrics(path)
    assert list(records) == GOOD_METRICS and records.skipped == 0 and records.warning() is None
    assert read_tasks(tmp_path / "missing.jsonl") == []
