"""A sweep on the dev cluster: a 2x2 grid (train.lr x train.seed) and a fifth point whose data
the trainer cannot use, ``max_parallel = 2``, 2-minute tasks, queued as ONE Slurm array.

- never more than 2 points run at once (Slurm's view, polled, and the tasks' own records);
- every grid point it was not told to stop reaches its max_steps through a time limit, and
  the task after each graceful stop starts at the step it saved (nothing recomputed);
- ``jobgen stop SWEEP/POINT`` stops that point while another keeps running;
- the bad-data point is marked failed, and the others go on;
- a second ``jobgen submit`` of the file with a point added runs the new point and leaves
  the finished ones untouched;
- ``jobgen status SWEEP`` and ``jobgen compare SWEEP -o FILE.png`` show them.

A point's max_steps is set (in its spec.json) once its first task has met the time limit,
a few steps past where it stopped: each point needs exactly two tasks, whatever the speed of
this machine that day.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers import jobgen, read_jsonl, submit, train_spec, wait_until_gone
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

SWEEP = """
[sweep]
max_parallel = 2
points = [{{ "data.path" = "{bad}" }}{added}]
[sweep.grid]
"train.lr" = [1e-3, 2e-3]
"train.seed" = [1, 2]
"""
GRID = ["lr-0.001_seed-1", "lr-0.001_seed-2", "lr-0.002_seed-1", "lr-0.002_seed-2"]
STOPPED = GRID[3]
EVAL = {"split": 0.1, "every_steps": 20}  # compare ranks the points by their best eval loss
ADDED = '{ "train.lr" = 3e-3, "train.max_steps" = 3 }'


def runs_root_env(sweep: Path) -> dict[str, str]:
    """Names (SWEEP, SWEEP/POINT) are looked up under $JOBGEN_RUNS_ROOT."""
    return {"JOBGEN_RUNS_ROOT": str(sweep.parent)}


def exits(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "exit"]


def set_max_steps(run: Path, max_steps: int) -> None:
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["train"]["max_steps"] = max_steps
    (run / "spec.json").write_text(json.dumps(spec))


def task_intervals(sweep: Path) -> list[tuple[float, float]]:
    """(start, end) of every task that ran a point, from the batch scripts' records."""
    out = []
    for path in sweep.glob("points/*/logs/task.*.json"):
        record = json.loads(path.read_text())
        if record.get("end") is not None:
            out.append((float(record["job_start"]), float(record["end"])))
    return out


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    now = peak = 0
    for _, change in events:
        now += change
        peak = max(peak, now)
    return peak


def watch(sweep: Path, job: int, stop_after: str, timeout: float) -> tuple[int, bool]:
    """Until the array has left the queue: the most tasks Slurm ran at once, and whether the
    point ``stop_after`` was stopped while another point kept running. Meanwhile each grid
    point's max_steps is set past its first time-limit stop, and ``stop_after`` is stopped
    once it has trained a step."""
    deadline, peak, extended, stopped, others_ran_on = time.monotonic() + timeout, 0, set(), False, False
    points = sweep / "points"  # each point's run directory (jobgen.runs.sweep_files)
    while time.monotonic() < deadline:
        queue = slurm.queue([job])
        running = [e for e in queue if e.state == "RUNNING"]
        peak = max(peak, len(running))
        for name in GRID:
            first = exits(points / name)
            if name not in extended and first and first[0]["exit_reason"].startswith("time limit"):
                set_max_steps(points / name, first[0]["end_step"] + 4)
                extended.add(name)
        if not stopped and read_jsonl(points / stop_after / "metrics.jsonl"):
            jobgen("stop", f"{sweep.name}/{stop_after}", env=runs_root_env(sweep), check=True)
            stopped = True
        if stopped and not others_ran_on and exits(points / stop_after):
            # The stopped point's task has ended: another point's task still runs.
            others_ran_on = any(e.state == "RUNNING" for e in slurm.queue([job]))
        if not queue:
            return peak, others_ran_on
        time.sleep(1)
    raise AssertionError(f"the sweep's array {job} still queued after {timeout:.0f} s: {slurm.queue([job])}")


def test_a_sweep_is_one_array_of_at_most_two_points_through_time_limits(cluster, tmp_path, tiny_model):
    bad = tmp_path / "no-columns.jsonl"
    bad.write_text('{"text": "a row without instruction or output"}\n' * 20)
    spec = train_spec(tmp_path, tiny_model, "lrs", procs_per_node=1, time_limit="2m", grace="50s", array=3, eval=EVAL)
    text = spec.read_text()
    spec.write_text(text + SWEEP.format(bad=bad, added=""))
    sweep = tmp_path / "runs" / "lrs"
    points = sweep / "points"  # each point's run directory (jobgen.runs.sweep_files)
    job = submit(spec)
    assert {e.array_job_id for e in slurm.queue([job])} == {job}  # one job in squeue

    peak, others_ran_on = watch(sweep, job, STOPPED, timeout=900)
    assert peak <= 2 and most_at_once(task_intervals(sweep)) == 2, (peak, task_intervals(sweep))
    assert others_ran_on, "stopping one point stopped the others"

    for name in [n for n in GRID if n != STOPPED]:
        run = points / name
        ended = exits(run)
        assert len(ended) == 2 and ended[0]["exit_reason"].startswith("time limit"), ended
        starts = [r["start_step"] for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "first_step"]
        assert starts == [0, ended[0]["end_step"]], (name, starts, ended)  # nothing recomputed
        spec_json = json.loads((run / "spec.json").read_text())
        assert ended[1]["end_step"] == spec_json["run"]["train"]["max_steps"] and (run / "done").exists()
        view = json.loads(jobgen("status", f"lrs/{name}", "--json", env=runs_root_env(sweep), check=True).stdout)
        assert view["state"] == "finished" and all(not t.get("recomputed_steps") for t in view["tasks"]), view
    assert "kill switch" in exits(points / STOPPED)[-1]["exit_reason"] and not (points / STOPPED / "done").exists()
    bad_name = next(
        p["name"] for p in json.loads((sweep / "sweep.json").read_text())["points"] if p["name"] not in GRID
    )
    failed = json.loads((points / bad_name / "failed").read_text())
    assert "needs column(s)" in failed["reason"], failed

    status = json.loads(jobgen("status", str(sweep), "--json", check=True).stdout)
    states = {p["name"]: p["state"] for p in status["points"]}
    assert states == {**dict.fromkeys(GRID, "finished"), STOPPED: "stopped", bad_name: "failed"}, status

    # Again, with a point added: it runs; the finished points are not touched.
    before = {name: (points / name / "metrics.jsonl").stat().st_mtime_ns for name in GRID}
    claims_before = len(read_jsonl(sweep / "claims.jsonl"))
    spec.write_text(text + SWEEP.format(bad=bad, added=", " + ADDED))
    second = submit(spec)
    wait_until_gone([second], timeout=600)
    added = "lr-0.003_max_steps-3"
    assert json.loads((points / added / "done").read_text()), added
    assert {name: (points / name / "metrics.jsonl").stat().st_mtime_ns for name in GRID} == before
    later = read_jsonl(sweep / "claims.jsonl")[claims_before:]
    assert not {c["point"] for c in later} & set(GRID), later
    # The failed point was tried again (a resubmission is the word that it is fixed): failed again.
    assert (points / bad_name / "failed").exists() and list((points / bad_name / "history").glob("failed-*"))

    # Logs and watchdogs per point and for the whole sweep.
    lines = jobgen("logs", "lrs", "--grep", "array task", env=runs_root_env(sweep), check=True).stdout
    assert all(f"{name} " in lines for name in GRID), lines
    watched = jobgen("watchdog", "run", "running", f"lrs/{GRID[0]}", env=runs_root_env(sweep))
    assert watched.returncode == 0 and "finished" in watched.stdout, watched.stdout + watched.stderr

    table = jobgen("compare", "lrs", env=runs_root_env(sweep), check=True).stdout
    rows = json.loads(jobgen("compare", "lrs", "--json", env=runs_root_env(sweep), check=True).stdout)
    assert [r["name"] for r in rows] == [line.split()[0] for line in table.splitlines()[1:]], table
    evaluated = [r["best_eval_loss"] for r in rows if r["best_eval_loss"] is not None]
    assert len(evaluated) >= 3 and evaluated == sorted(evaluated), table  # best eval loss first
    rest = [r["final_loss"] for r in rows[len(evaluated) :] if r["final_loss"] is not None]
    assert rest == sorted(rest) and {r["name"] for r in rows} == {*GRID, added, bad_name}, table
    out = jobgen("compare", str(sweep), "-o", str(tmp_path / "sweep.png"), check=True)
    assert (tmp_path / "sweep.png").stat().st_size > 0, out.stdout
