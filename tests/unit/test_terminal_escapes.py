"""Text from a run's files reaches the terminal with its control characters shown as escapes,
never acted on (jobgen.base.visible): a prompt or a completion in samples.jsonl, every reason and
name ``jobgen status`` shows, a sweep's point names and values in ``jobgen compare``, the
prefixes of ``jobgen logs``, a watchdog's alert. Each file is written as a hostile teammate
or a misbehaving program would: OSC sequences that set the window title and write the
clipboard, CSI that clears the screen, a one-byte C1 CSI, a bidirectional override, a
carriage return, and a newline with a line after it that looks like jobgen's own. The real
command line runs each (subprocess); ``--json`` stays JSON, which escapes them itself.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from helpers import jobgen
from jobgen.runs.rundir import RunDir
from run_dirs import batch_end_record, training_run_at_step_25

HOSTILE = "\x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\x9b31m\u202eevil\rX\nFAKE jobgen: ok"
# What must never reach the terminal from a file: ESC, BEL, C1 CSI, the bidi override, CR.
RAW = re.compile("[\x1b\x07\x9b\u202e\r]")


def assert_shown_escaped(text: str) -> None:
    """No control character of HOSTILE in ``text``; HOSTILE itself, escaped, is there."""
    raw = RAW.search(text)
    assert raw is None, f"raw {raw.group()!r} in: {text!r}"
    assert r"\x1b]0;pwned\x07" in text, text
    assert "\nFAKE jobgen: ok" not in text, text  # the newline inside a field is shown, not made


def test_visible_escapes_every_control_and_keeps_text():
    from jobgen.base.visible import visible, visible_lines

    assert visible(HOSTILE) == (
        r"\x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\x9b31m\u202eevil\rX\nFAKE jobgen: ok"
    )
    assert (
        visible("tab\there, DEL\x7f, NUL\x00, LRI\u2066, LS\u2028")
        == r"tab\there, DEL\x7f, NUL\x00, LRI\u2066, LS\u2028"
    )
    assert visible("naïve 日本語 — ok") == "naïve 日本語 — ok"  # printable text is left alone
    assert visible_lines("one\n\ttwo\x1b[2J\r") == "one\n\ttwo\\x1b[2J\\r"  # a block keeps its lines


@pytest.fixture
def hostile_run(tmp_path: Path) -> RunDir:
    """A training run whose every printed record carries HOSTILE."""
    run = training_run_at_step_25(tmp_path)
    (run.path / "switches").mkdir()
    lines = [{"step": s, "prompt": f"say {HOSTILE}", "completion": f"ok {HOSTILE}"} for s in (5, 10)]
    run.samples.write_text("".join(json.dumps(x) + "\n" for x in lines))
    batch_end_record(run, 18, 2, 3, 1, f"crashed {HOSTILE}", array=17, start=1200.0, end=1300.0)
    exit_record = {"time": 1100.0, "job_id": "17", "restart": 0, "event": "exit", "start_step": 0, "end_step": 25,
                   "exit_code": 3, "exit_reason": f"program said {HOSTILE}", "array_job_id": "17",
                   "array_task": "1"}  # fmt: skip
    (run.path / "tasks.jsonl").write_text(json.dumps(exit_record) + "\n")
    failed = {"exit_code": 3, "reason": f"it failed: {HOSTILE}", "fix": f"fix {HOSTILE}", "job_id": "17"}
    run.failed_marker.write_text(json.dumps(failed))
    (run.switches / f"kill{HOSTILE.replace(chr(10), '').replace('/', '')}").write_text("")
    run.quarantine.write_text(json.dumps({"nodes": {"node3": {"since": 1000.0, "job": "17_1", "reason": HOSTILE}}}))
    (run.checkpoints / f"broken-{HOSTILE.replace(chr(10), '').replace('/', '')}").mkdir(parents=True)
    return run


def test_samples_show_prompts_and_completions_escaped(hostile_run):
    proc = jobgen("samples", str(hostile_run.path))
    assert proc.returncode == 0, proc.stderr
    assert_shown_escaped(proc.stdout)
    assert proc.stdout.count("prompt ") == 1 and "step 10 | ok" in proc.stdout, proc.stdout

    proc = jobgen("samples", str(hostile_run.path), "--json")
    assert proc.returncode == 0 and not RAW.search(proc.stdout), proc.stdout
    assert json.loads(proc.stdout)[0]["prompt"] == f"say {HOSTILE}"  # JSON keeps the text, escaped by JSON


def test_status_shows_every_reason_and_name_escaped(hostile_run):
    proc = jobgen("status", str(hostile_run.path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert_shown_escaped(out)
    for field in ("crashed ", "program said ", "it failed: ", "fix ", r"switches kill\x1b", r"broken-\x1b"):
        assert field in out, (field, out)

    proc = jobgen("status", str(hostile_run.path), "--json")
    assert proc.returncode == 0 and not RAW.search(proc.stdout), proc.stdout
    view = json.loads(proc.stdout)
    assert view["tasks"][0]["exit_reason"] == f"program said {HOSTILE}", view["tasks"]


def test_the_listing_shows_a_hostile_name_escaped(hostile_run):
    # A run directory named by a teammate, its spec.json unreadable: the listing names it.
    odd = hostile_run.path.parent / HOSTILE.replace("\n", "").replace("/", "")
    odd.mkdir()
    (odd / "spec.json").write_text(f"not json {HOSTILE}")
    proc = jobgen("status", env={"JOBGEN_RUNS_ROOT": str(hostile_run.path.parent)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # the listing is incomplete
    assert not RAW.search(out), out
    assert r"\x1b]0;pwned\x07" in out and "unreadable" in out, out


def test_compare_shows_override_values_escaped_and_refuses_a_hostile_point_name(tmp_path):
    # Point names and override keys are plain words (jobgen.runs.sweep_files refuses anything else);
    # an override's value is the user's own text, shown escaped.
    sweep = tmp_path / "runs" / "hostile"
    sweep.mkdir(parents=True)
    points = [{"name": "p1", "overrides": {"train.lr": f"v{HOSTILE}"}, "attempts": 1}]
    (sweep / "sweep.json").write_text(json.dumps({"name": "hostile", "points": points, "jobs": []}))
    proc = jobgen("compare", str(sweep))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not RAW.search(out), out
    assert out.count(r"\x1b]0;pwned\x07") == 1 and "pending" in out, out

    name = HOSTILE.replace("\n", "").replace("/", "")
    points = [{"name": name, "overrides": {"train.lr": 1}, "attempts": 1}]
    (sweep / "sweep.json").write_text(json.dumps({"name": "hostile", "points": points, "jobs": []}))
    proc = jobgen("compare", str(sweep))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and len(out.splitlines()) == 1, out
    assert not RAW.search(out) and "points[0].name: not a point's name" in out, out


def test_logs_prefixes_are_escaped_and_the_lines_are_the_programs_own(hostile_run):
    node = HOSTILE.replace("\n", "").replace("/", "")
    rank_dir = hostile_run.logs / "ranks" / "17" / node / "launch0" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_text("2026-11-27T10:00:00 trainer[0] plain line\n")
    proc = jobgen("logs", str(hostile_run.path))
    assert proc.returncode == 0, proc.stderr
    assert not RAW.search(proc.stdout), proc.stdout
    assert r"\x1b]0;pwned\x07" in proc.stdout and "| 2026-11-27T10:00:00 trainer[0] plain line" in proc.stdout


def test_a_watchdogs_alert_is_escaped(hostile_run, monkeypatch, capsys):
    from jobgen.slurm import client as slurm
    from watchdogs.running import main

    os.unlink(hostile_run.failed_marker)  # ended, neither finished nor stopped: the running check alerts
    for path in hostile_run.switches.iterdir():
        path.unlink()
    monkeypatch.setattr(slurm, "queue", lambda job_ids=None: [])  # Slurm answers: nothing queued
    monkeypatch.setattr(slurm, "config", lambda: {})
    monkeypatch.setattr(slurm, "show_job", lambda job_id: [])
    assert main(["--run", str(hostile_run.path)]) == 1
    out = capsys.readouterr().out
    assert not RAW.search(out), out
    assert r"crashed \x1b]0;pwned\x07" in out, out
