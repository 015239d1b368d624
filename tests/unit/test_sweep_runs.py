"""A sweep's points as runs: SWEEP and SWEEP/POINT as names, the job name and job ids Slurm
knows a point's tasks by, W&B's group, and ``jobgen status SWEEP`` from the files (a sweep
with no job queued: Slurm is not asked)."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from helpers import jobgen, small_sweep
from jobgen.runs.rundir import RunDir
from jobgen.runs.sweep_runs import find_point, find_sweep, slurm_view, sweep_name
from jobgen.slurm import client as slurm
from jobgen.sweep.points import load_sweep
from jobgen.sweep.status import format_sweep_status, sweep_status
from jobgen.sweep.submit import submit_sweep


@pytest.fixture()
def sweep(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setattr(slurm, "sbatch", lambda script, options: 41)
    monkeypatch.setattr(slurm, "queue", lambda ids: [])
    path = small_sweep(tmp_path, train={"report_to": ["wandb"]})
    submit_sweep(load_sweep(path), source_text=path.read_text(), skip_preflight=True)
    return tmp_path / "runs" / "lrs"


def point(sweep: Path, name: str) -> Path:
    """A point's run directory: points/<name> (beside sweep.json in jobgen before points/:
    the tests of the defects of issue 30 ran on that code too)."""
    return sweep / "points" / name if (sweep / "points").is_dir() else sweep / name


def claim(sweep: Path, point: str, job_id: int, task: int) -> None:
    line = {"point": point, "job_id": str(job_id), "array_job_id": "41", "task": str(task), "restart": 0}
    with open(sweep / "claims.jsonl", "a") as handle:
        handle.write(json.dumps(line) + "\n")
    (sweep / "claims").mkdir(exist_ok=True)
    (sweep / "claims" / f"{point}.json").write_text(json.dumps(line))


def test_names_find_the_sweep_and_its_points(sweep):
    root = sweep.parent
    assert find_sweep("lrs", root) == sweep and find_sweep(str(sweep), None) == sweep.absolute()
    assert find_point("lrs/lr-0.001", root).path == sweep / "points" / "lr-0.001"
    assert find_point("lrs/../lrs", root) is None and find_point("lrs/nope", root) is None
    assert find_sweep("lrs/lr-0.001", root) is None


def test_a_points_tasks_are_the_sweeps_job_with_the_ids_that_claimed_it(sweep):
    claim(sweep, "lr-0.001", 42, 1)
    claim(sweep, "lr-0.002", 43, 2)
    claim(sweep, "lr-0.001", 44, 3)
    assert slurm_view(RunDir(point(sweep, "lr-0.001")), "lr-0.001") == ("lrs", {42, 44})
    assert slurm_view(RunDir(point(sweep, "lr-0.002")), "lr-0.002") == ("lrs", {43})
    single = RunDir(sweep.parent / "alone")
    assert slurm_view(single, "alone") == ("alone", None) and sweep_name(single) is None


def test_wandb_groups_a_sweeps_points_under_the_sweeps_name(sweep, monkeypatch):
    from trainer.tracking import trackers_for_run

    calls: list[dict] = []
    fake = types.SimpleNamespace(
        init=lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(finish=lambda: None)
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = RunDir(point(sweep, "lr-0.002"))
    trackers_for_run(run.load_spec(), run, 0, enabled=True)
    assert [(c["group"], c["name"]) for c in calls] == [("lrs", "lr-0.002")]


def test_status_of_a_sweep_names_each_points_state(sweep):
    (point(sweep, "lr-0.001") / "done").write_text("{}")
    (point(sweep, "lr-0.001") / "metrics.jsonl").write_text(
        json.dumps({"time": 1764219600.0, "step": 5, "loss": 1.25}) + "\n"
    )
    status = sweep_status(sweep)
    assert [(p["name"], p["state"], p["step"], p["loss"]) for p in status["points"]] == [
        ("lr-0.001", "finished", 5, 1.25),
        ("lr-0.002", "stopped", None, None),  # no job of the sweep is left to run it
    ]
    assert status["state"] == "stopped" and status["jobs"] == [41]
    text = format_sweep_status(status)
    assert "lr-0.001  finished" in text and "train.lr=0.001" in text and "5/" in text


def test_jobgen_status_and_stop_take_a_sweep(sweep):
    env = {"JOBGEN_RUNS_ROOT": str(sweep.parent)}
    out = jobgen("stop", "lrs/lr-0.002", env=env, check=True)
    assert (point(sweep, "lr-0.002") / "switches" / "kill").is_file() and not (
        point(sweep, "lr-0.001") / "switches" / "kill"
    ).exists()
    out = jobgen("stop", "lrs", env=env, check=True)
    assert (point(sweep, "lr-0.001") / "switches" / "kill").is_file(), out.stdout
    assert "already set" in out.stdout


def entry(job_id: int, task: str, state: str) -> slurm.QueueEntry:
    start = 1764219600.0 if state == "RUNNING" else None
    return slurm.QueueEntry(job_id, 41, task, state, "None", "0:10", "2:00", "node1", "lrs", start)


def test_a_points_status_has_its_own_tasks_and_while_open_the_arrays_waiting_ones(sweep):
    from jobgen.report.status import run_status

    claim(sweep, "lr-0.001", 42, 1)
    claim(sweep, "lr-0.002", 43, 2)
    # Task 1 runs lr-0.001, task 2 lr-0.002; tasks 3-4 have not started (they carry the array's id).
    queue = [entry(42, "1", "RUNNING"), entry(43, "2", "RUNNING"), entry(41, "[3-4%2]", "PENDING")]
    mine = run_status(RunDir(point(sweep, "lr-0.001")), queue=queue, details=False, ended=False)
    assert [(t.job_id, t.state) for t in mine.tasks] == [(41, "PENDING"), (42, "RUNNING")], mine.tasks
    assert mine.state == "running"
    (point(sweep, "lr-0.002") / "done").write_text("{}")  # finished: the array's waiting tasks are not its
    theirs = run_status(RunDir(point(sweep, "lr-0.002")), queue=queue, details=False, ended=False)
    assert [t.job_id for t in theirs.tasks] == [43], theirs.tasks


def test_compare_calls_a_point_with_its_kill_switch_stopped(sweep):
    from jobgen.report.compare import compare

    line = {"time": 1764219600.0, "step": 2, "loss": 2.5}
    (point(sweep, "lr-0.002") / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    RunDir(point(sweep, "lr-0.002")).set_switch("kill")
    rows = {row.name: row.state for row in compare([str(sweep)], None)}
    assert rows == {"lr-0.001": "unknown", "lr-0.002": "stopped"}  # as jobgen status says: no task known


def test_the_listing_of_runs_has_every_point_of_a_sweep(sweep, monkeypatch):
    from jobgen.cli import status as cli_status

    (sweep.parent / "alone").mkdir()
    (sweep.parent / "alone" / "spec.json").write_text((point(sweep, "lr-0.001") / "spec.json").read_text())
    monkeypatch.setattr(cli_status, "default_runs_root", lambda: sweep.parent)
    assert [r.path for r in cli_status._all_runs()] == [
        sweep.parent / "alone",
        point(sweep, "lr-0.001"),
        point(sweep, "lr-0.002"),
    ]


def test_a_sweep_without_slurm_to_ask_is_unknown_not_stopped(sweep, monkeypatch):
    def unreachable(ids):
        raise slurm.SlurmUnavailable(["squeue"], 124, "no answer within 60s (is slurmctld up?)")

    monkeypatch.setattr(slurm, "queue", unreachable)
    status = sweep_status(sweep)
    assert [p["state"] for p in status["points"]] == ["unknown", "unknown"] and status["state"] == "unknown"
    assert "Slurm not reachable" in status["notes"][0]


def test_a_sweep_index_that_cannot_be_read_is_a_sentence(sweep):
    env = {"JOBGEN_RUNS_ROOT": str(sweep.parent)}
    (sweep / "sweep.json").write_text('{"points": [{"name": "x"}]}')
    for command in (["status", "lrs"], ["stop", "lrs"], ["logs", "lrs"]):
        out = jobgen(*command, env=env)
        assert out.returncode != 0 and "Traceback" not in out.stderr and "sweep.json" in out.stderr, (command, out)


def test_serve_and_status_watch_take_a_point_not_a_sweep(sweep):
    from jobgen.serve.submit import find_target

    assert find_target("lrs/lr-0.001", sweep.parent).state.path == point(sweep, "lr-0.001")
    out = jobgen("status", "lrs", "--watch", env={"JOBGEN_RUNS_ROOT": str(sweep.parent)})
    assert out.returncode != 0 and "lrs/POINT" in out.stderr, out.stderr


# ---------------------------------------------------------------- damaged and foreign files (issue 30)


def runs_root(sweep: Path) -> dict[str, str]:
    return {"JOBGEN_RUNS_ROOT": str(sweep.parent)}


def one_line(out) -> bool:
    """A command's refusal: no traceback, one line on stderr naming sweep.json."""
    return "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1 and "sweep.json" in out.stderr


def kill_switches(root: Path) -> list[Path]:
    return sorted(root.rglob("switches/kill"))


def test_claim_lines_and_claim_files_that_cannot_be_read_are_skipped_by_status(sweep):
    claim(sweep, "lr-0.001", 42, 1)
    with open(sweep / "claims.jsonl", "a") as handle:
        handle.write('[1]\n{"job_id": "43", "array_job_id": "41"}\n"text"\n{"point": "lr-0.002", "job_id": "\u00b2"}\n')
    (sweep / "claims").mkdir(exist_ok=True)
    (sweep / "claims" / "lr-0.002.json").write_text("[]")
    out = jobgen("status", "lrs/lr-0.001", env=runs_root(sweep))
    assert out.returncode == 0 and "Traceback" not in out.stderr and "lr-0.001" in out.stdout, out
    out = jobgen("status", "lrs", env=runs_root(sweep))
    assert out.returncode == 0 and "Traceback" not in out.stderr and "lr-0.002" in out.stdout, out
    status = sweep_status(sweep)
    assert [p["name"] for p in status["points"]] == ["lr-0.001", "lr-0.002"]
    assert any("4 line(s) skipped" in note for note in status["notes"]), status["notes"]


DAMAGED_INDEX = {
    "jobs is no list": lambda index: {**index, "jobs": 5},
    "a job id that is no number": lambda index: {**index, "jobs": [{"job_id": "\u00b2"}]},  # '²'.isdigit()
    "overrides that are no table": lambda index: {
        **index,
        "points": [{**index["points"][0], "overrides": [1, 2]}, *index["points"][1:]],
    },
}


@pytest.mark.parametrize("damage", list(DAMAGED_INDEX))
def test_a_damaged_sweep_index_is_one_line_and_nothing_is_acted_on(sweep, damage):
    alone = sweep.parent / "alone"
    alone.mkdir()
    (alone / "spec.json").write_text((point(sweep, "lr-0.001") / "spec.json").read_text())
    index = json.loads((sweep / "sweep.json").read_text())
    (sweep / "sweep.json").write_text(json.dumps(DAMAGED_INDEX[damage](index)))
    env = runs_root(sweep)
    for command, code in ((["status", "lrs"], 1), (["status", "lrs/lr-0.001"], 1), (["compare", "lrs"], 2)):
        out = jobgen(*command, env=env)
        assert out.returncode == code and one_line(out), (command, out)
    # Every run listed: the others as usual, the sweep's points unreadable by their sweep.json.
    out = jobgen("status", "--json", env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out
    listed = {Path(s["run_dir"]).name: s for s in json.loads(out.stdout)}
    assert listed.keys() == {"alone", "lr-0.001", "lr-0.002"} and listed["alone"]["state"] != "unreadable", listed
    for name in ("lr-0.001", "lr-0.002"):
        assert listed[name]["state"] == "unreadable" and "sweep.json" in listed[name]["warnings"][0], listed[name]
    # stop sets no switch from an index it cannot trust.
    out = jobgen("stop", "lrs", env=env)
    assert out.returncode == 1 and one_line(out) and kill_switches(sweep.parent) == [], out


def test_stop_acts_on_the_sweeps_own_points_never_on_a_directory_sweep_json_names(sweep):
    other = sweep.parent / "other"
    (other / "switches").mkdir(parents=True)
    (other / "spec.json").write_text((point(sweep, "lr-0.001") / "spec.json").read_text())
    index = json.loads((sweep / "sweep.json").read_text())
    index["points"][0]["dir"] = str(other)  # a hand edit, a teammate's, or a file from elsewhere
    index["points"][0]["kill"] = str(other / "switches" / "kill")
    (sweep / "sweep.json").write_text(json.dumps(index))
    out = jobgen("stop", "lrs", env=runs_root(sweep), check=True)
    assert kill_switches(sweep.parent) == [point(sweep, n) / "switches" / "kill" for n in ("lr-0.001", "lr-0.002")]
    assert str(other) not in out.stdout


def test_a_moved_sweep_is_acted_on_where_it_is(sweep, tmp_path):
    moved = tmp_path / "elsewhere" / "lrs"
    shutil.copytree(sweep, moved, symlinks=True)
    env = runs_root(moved)
    status = json.loads(jobgen("status", "lrs", "--json", env=env, check=True).stdout)
    assert [p["run_dir"] for p in status["points"]] == [str(point(moved, n)) for n in ("lr-0.001", "lr-0.002")]
    rows = json.loads(jobgen("compare", "lrs", "--json", env=env, check=True).stdout)
    assert sorted(r["run_dir"] for r in rows) == [str(point(moved, n)) for n in ("lr-0.001", "lr-0.002")]
    jobgen("stop", "lrs", env=env, check=True)
    assert kill_switches(tmp_path) == [point(moved, n) / "switches" / "kill" for n in ("lr-0.001", "lr-0.002")]


def test_a_point_that_is_a_link_out_of_the_sweep_is_refused(sweep):
    other = sweep.parent / "other"
    point(sweep, "lr-0.002").rename(other)  # a whole run directory, elsewhere
    point(sweep, "lr-0.002").symlink_to(other)
    for command in (["stop", "lrs"], ["status", "lrs"]):
        out = jobgen(*command, env=runs_root(sweep))
        assert out.returncode == 1 and "Traceback" not in out.stderr and "symbolic link" in out.stderr, out
    assert kill_switches(sweep.parent) == []


def test_watchdogs_and_quarantine_meet_a_damaged_sweep_index_with_one_line(sweep, monkeypatch, capsys):
    """`jobgen watchdog install SWEEP` refuses in one line naming sweep.json, and a point's
    quarantine still keeps its own nodes off the sweep's pending tasks (it used to raise)."""
    from jobgen.runs import quarantine

    spec = RunDir(point(sweep, "lr-0.001")).load_spec()
    (sweep / "sweep.json").write_text('{"points": 5}')
    out = jobgen("watchdog", "install", "lrs", env=runs_root(sweep))
    assert out.returncode == 1 and one_line(out) and "sweep.json" in out.stderr, out
    assert "Traceback" not in out.stdout + out.stderr, out

    quarantine.add(RunDir(point(sweep, "lr-0.001")), {"node7": "went silent"}, "41_1")
    pending = types.SimpleNamespace(slurm_id="41_2", state="PENDING")
    updates: list[tuple[str, dict]] = []
    monkeypatch.setattr(slurm, "queue_named", lambda name: [pending])
    monkeypatch.setattr(slurm, "update_job", lambda job, **fields: updates.append((job, fields)))
    assert quarantine.exclude_from_pending(RunDir(point(sweep, "lr-0.001")), spec) == ["41_2"]
    assert updates == [("41_2", {"ExcNodeList": "node7"})], updates
    assert "sweep.json" in capsys.readouterr().err
