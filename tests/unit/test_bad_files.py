"""Run-directory records that are readable JSON but not what jobgen wrote: the tools name the
file and what is wrong, and show the rest; none of them prints a traceback.

``quarantine.json`` is checked as a whole (jobgen.runs.quarantine.read, QuarantineError); the lines
of ``metrics.jsonl`` and ``tasks.jsonl`` one by one (jobgen.runs.goodput.read_records), a bad line
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
    from jobgen.runs.jsonl_records import read_metrics, read_tasks

    path = tmp_path / "metrics.jsonl"
    _write_lines(path, GOOD_METRICS, "[1, 2, 3]")
    records = read_metrics(path)
    assert list(records) == GOOD_METRICS and records.skipped == 1
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD_METRICS) + '{"cut')  # a crash mid-write
    records = read_metrics(path)
    assert list(records) == GOOD_METRICS and records.skipped == 0 and records.warning() is None
    assert read_tasks(tmp_path / "missing.jsonl") == []


# ---------------------------------------------------------------- issue 30, item 11
# Each of these was a traceback: now one line naming the file, the rest still shown, nothing
# acted on wrongly, and the exit status the command documents.


def _named_once(out: str, path: Path) -> list[str]:
    return [line for line in out.splitlines() if str(path) in line]


@pytest.fixture
def trained(tmp_path):
    """A run at step 25 with an evaluation logged and a switches/ directory."""
    from run_dirs import training_run_at_step_25

    run = training_run_at_step_25(tmp_path)
    (run.path / "switches").mkdir()
    with (run.path / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"time": 1030.0, "step": 25, "event": "eval", "eval_loss": 1.25}) + "\n")
    return run


def test_best_json_with_a_non_numeric_eval_loss_is_a_warning(trained):
    trained.checkpoints.mkdir()
    trained.best_checkpoint.write_text(json.dumps({"step": 20, "checkpoint": "step-00000020", "eval_loss": "x"}))
    for args in (["status", str(trained.path)], ["compare", str(trained.path)]):
        proc = jobgen(*args)
        _assert_clean(proc)
        named = _named_once(proc.stdout + proc.stderr, trained.best_checkpoint)
        assert len(named) == 1 and "eval_loss" in named[0], proc.stdout + proc.stderr
        assert "1.2500" in proc.stdout, proc.stdout  # the lowest logged stands in for the best
    proc = jobgen("status", env={"JOBGEN_RUNS_ROOT": str(trained.path.parent)})
    _assert_clean(proc)
    assert "best.json" in proc.stdout and "25/60" in proc.stdout, proc.stdout
    proc = jobgen("status", str(trained.path), "--json")
    _assert_clean(proc)
    assert json.loads(proc.stdout)["eval_best"] == {"step": 25, "eval_loss": 1.25, "checkpoint": None}


def test_best_json_of_a_sweeps_point_is_a_warning_in_the_sweeps_status(tmp_path, sbatch_calls):
    from helpers import small_sweep
    from jobgen.runs.sweep_files import POINTS_DIR
    from jobgen.sweep.points import load_sweep
    from jobgen.sweep.submit import submit_sweep

    path = small_sweep(tmp_path)
    submit_sweep(load_sweep(path), source_text=path.read_text(), skip_preflight=True)
    point = tmp_path / "runs" / "lrs" / POINTS_DIR / "lr-0.001"
    lines = [{"time": 1000.0, "step": 20, "loss": 2.5}, {"time": 1001.0, "step": 20, "event": "eval", "eval_loss": 1.5}]
    (point / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (point / "checkpoints" / "best.json").write_text('{"step": 20, "checkpoint": "step-00000020", "eval_loss": "x"}')
    for view in ([], ["--json"]):
        proc = jobgen("status", str(tmp_path / "runs" / "lrs"), *view)
        _assert_clean(proc)
        assert "lr-0.001" in proc.stdout and "lr-0.002" in proc.stdout, proc.stdout
        assert "1.5" in proc.stdout, proc.stdout  # the lowest eval loss logged stands in


def test_a_samples_line_that_is_no_object_is_skipped_and_named(trained):
    lines = ["[1, 2]", json.dumps({"step": 5, "prompt": "hi", "completion": "hello"}), '"text"']
    trained.samples.write_text("\n".join(lines) + "\n")
    proc = jobgen("samples", str(trained.path))
    _assert_clean(proc)
    assert "step 5 | hello" in proc.stdout, proc.stdout
    named = _named_once(proc.stderr, trained.samples)
    assert len(named) == 1 and "skipped 2 line(s)" in named[0] and "line 1: a JSON list" in named[0], proc.stderr


BAD_SPECS = {"an empty object": "{}", "a list": "[]", "garbage": "garbage{"}


@pytest.mark.parametrize("text", list(BAD_SPECS.values()), ids=list(BAD_SPECS))
def test_a_damaged_spec_json_is_one_line_and_nothing_is_done_wrongly(trained, text, tmp_path):
    trained.spec_file.write_text(text)
    log = trained.batch_log("stat", 17)
    log.write_text("2026-11-27T10:00:00 jobgen: a line of the job\n")

    proc = jobgen("compare", str(trained.path))  # the row, without the total steps
    _assert_clean(proc)
    assert "25" in proc.stdout and len(_named_once(proc.stderr, trained.spec_file)) == 1, proc.stdout + proc.stderr

    proc = jobgen("logs", str(trained.path))  # the logs are still there, by the directory's name
    _assert_clean(proc)
    assert "a line of the job" in proc.stdout and len(_named_once(proc.stderr, trained.spec_file)) == 1

    target = tmp_path / "exported"
    proc = jobgen("export", str(trained.path), "--to", str(target))  # refused before anything is read or written
    _assert_clean(proc, 2)
    assert len(_named_once(proc.stderr, trained.spec_file)) == 1 and not target.exists(), proc.stderr

    proc = jobgen("stop", str(trained.path))  # needs only the directory: it works, and says so
    _assert_clean(proc)
    assert "created" in proc.stdout and trained.switch("kill").is_file(), proc.stdout

    for check in ("running", "hang"):  # a watchdog that cannot look alerts, naming the file
        proc = jobgen("watchdog", "run", check, str(trained.path))
        _assert_clean(proc, 1)
        assert len(_named_once(proc.stdout + proc.stderr, trained.spec_file)) == 1, proc.stdout + proc.stderr

    proc = jobgen("status", str(trained.path))
    _assert_clean(proc, 1)
    assert len(_named_once(proc.stderr, trained.spec_file)) == 1, proc.stderr


@pytest.mark.parametrize("pattern", ["a{99999999999}", "(unclosed", "(" * 2000 + ")" * 2000])
def test_a_grep_pattern_python_cannot_use_is_one_line(trained, pattern):
    proc = jobgen("logs", str(trained.path), "--grep", pattern)
    _assert_clean(proc, 2)
    assert len(proc.stderr.strip().splitlines()) == 1 and "--grep" in proc.stderr, proc.stderr


@pytest.mark.parametrize("text", ["[1, 2]", '{"jobs": []}', "garbage"])
def test_a_damaged_jobs_json_refuses_a_submission_before_sbatch(run, sbatch_calls, text):
    from jobgen.launch.submit import SubmitError, submit
    from jobgen.spec.loader import load_run

    run.jobs_file.write_text(text)
    spec = load_run(str(run.path.parent.parent / "run.toml"))
    with pytest.raises(SubmitError) as refused:
        submit(spec, after=5, skip_preflight=True)  # chained: no busy check reads jobs.json first
    assert sbatch_calls == [], "a job was queued that jobs.json could not record"
    assert [f for f in refused.value.findings if str(run.jobs_file) in f.message and f.level == "error"]
    assert run.jobs_file.read_text() == text


def test_a_link_above_the_file_is_followed_a_link_at_the_file_is_refused(trained, tmp_path):
    # checkpoints/ on a scratch file system, linked in: its best.json is read as any other.
    scratch = tmp_path / "scratch" / "checkpoints"
    scratch.mkdir(parents=True)
    best = {"step": 25, "checkpoint": "step-00000025", "eval_loss": 1.25}
    (scratch / "best.json").write_text(json.dumps(best))
    trained.checkpoints.symlink_to(scratch, target_is_directory=True)
    proc = jobgen("status", str(trained.path), "--json")
    _assert_clean(proc)
    assert json.loads(proc.stdout)["eval_best"]["checkpoint"] == "step-00000025", proc.stdout
    # best.json itself a link (to a teammate's file): refused, named, and the rest still shown.
    (scratch / "best.json").unlink()
    (scratch / "best.json").symlink_to(tmp_path / "teammates-best.json")
    (tmp_path / "teammates-best.json").write_text(json.dumps(best))
    proc = jobgen("status", str(trained.path), "--json")
    _assert_clean(proc)
    view = json.loads(proc.stdout)
    assert view["eval_best"]["checkpoint"] is None and view["step"] == 25, view
    assert [w for w in view["warnings"] if "best.json: is a symbolic link" in w], view["warnings"]
