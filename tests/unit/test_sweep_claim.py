"""jobgen.sweep.claim: which point an array task of a sweep runs, and the throttle it asks
for. The points' files are fabricated; which jobs are alive is the test's (the batch script
asks squeue: tests/cluster/test_slurm_sweep.py runs the claim in real Slurm tasks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobgen.runs.rundir import RunDir
from jobgen.sweep import claim as sweep_claim
from jobgen.sweep.claim import claim, closed_reason, parse_args


def point_path(sweep: Path, name: str, fmt: int = 2) -> Path:
    """Where a point's run directory is: points/<name> (format 1: beside sweep.json)."""
    return sweep / "points" / name if fmt == 2 else sweep / name


def make_sweep(tmp_path: Path, names: list[str], *, attempts: int = 3, max_parallel: int = 2, fmt: int = 2) -> Path:
    """A submitted sweep as jobgen writes it: each point's directory with its spec.json (a run
    directory exists by it) and switches/. Format 1 is the layout of jobgen before points/:
    the points beside sweep.json, whose entries named their files' paths."""
    sweep = tmp_path / "sweep"
    points = []
    for name in names:
        run = point_path(sweep, name, fmt)
        (run / "switches").mkdir(parents=True)
        (run / "spec.json").write_text("{}")
        entry = {"name": name, "overrides": {}, "program": "train", "attempts": attempts}
        if fmt == 1:
            entry = {
                "name": name,
                "overrides": {},
                "dir": str(run),
                "script": str(run / "train.sbatch"),
                "log": str(run / "logs" / f"{name}-{{job_id}}.out"),
                "done": str(run / "done"),
                "failed": str(run / "failed"),
                "kill": str(run / "switches" / "kill"),
                "attempts": attempts,
            }
        points.append(entry)
    (sweep / "sweep.json").write_text(
        json.dumps({"format": fmt, "name": "s", "max_parallel": max_parallel, "points": points})
    )
    return sweep


def args(job: int, task: int, array_job: int = 100):
    return parse_args(
        ["--sweep", "x", "--job", str(job), "--array-job", str(array_job), "--task", str(task), "--live-unknown"]
    )


def take(sweep: Path, job: int, task: int, alive, array_job: int = 100) -> str | None:
    point = claim(sweep, args(job, task, array_job), alive).point
    return point.name if point else None


def claimed(sweep: Path) -> list[str]:
    """The points claims.jsonl names, oldest first (its lines that are claims)."""
    out = []
    for line in (sweep / "claims.jsonl").read_text().splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and "point" in value and str(value.get("job_id")).isdecimal():
            out.append(value["point"])
    return out


def run_claim(sweep: Path, job: int, live: str, capsys) -> tuple[int, list[str], str]:
    """``python -m jobgen.sweep.claim`` as the batch script runs it: exit status, stdout's lines, stderr."""
    argv = ["--sweep", str(sweep), "--job", str(job), "--array-job", "100", "--task", str(job - 100), "--live", live]
    code = sweep_claim.main(argv)
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def test_tasks_take_the_points_in_turn_and_never_one_held_by_a_live_task(tmp_path):
    sweep = make_sweep(tmp_path, ["a", "b", "c"])
    alive = {"101", "102"}
    assert [take(sweep, job, job - 100, lambda j: j in alive) for job in (101, 102, 103)] == ["a", "b", "c"]
    # 101 ended (its limit): the next task takes the point with the fewest tasks that is free.
    alive = {"102", "103"}
    outcome = claim(sweep, args(104, 4), lambda j: j in alive)
    assert (outcome.point.name, outcome.throttle, outcome.held) == ("a", 2, 2)  # three open: the throttle is K = 2
    assert claimed(sweep) == ["a", "b", "c", "a"]


def test_closed_points_are_skipped_and_the_throttle_drops_to_what_is_left(tmp_path):
    sweep = make_sweep(tmp_path, ["a", "b", "c", "d"])
    (sweep / "points" / "a" / "done").touch()
    (sweep / "points" / "b" / "failed").write_text("{}")
    (sweep / "points" / "c" / "switches" / "kill").touch()
    outcome = claim(sweep, args(101, 1), lambda j: False)
    assert (outcome.point.name, outcome.throttle) == ("d", 1)
    (sweep / "points" / "d" / "done").touch()
    outcome = claim(sweep, args(102, 2), lambda j: False)
    assert (outcome.point, outcome.throttle, outcome.held) == (None, 0, 0)  # nothing open: cancel the rest


def test_a_link_named_kill_does_not_stop_a_point(tmp_path):
    sweep = make_sweep(tmp_path, ["a"])
    (sweep / "points" / "a" / "switches" / "kill").symlink_to(tmp_path / "elsewhere")
    assert closed_reason(RunDir(sweep / "points" / "a"), 3, 0) is None


def test_a_point_out_of_tasks_in_this_array_gets_new_ones_in_the_next(tmp_path):
    sweep = make_sweep(tmp_path, ["a"], attempts=2)
    assert [take(sweep, job, job - 100, lambda j: False) for job in (101, 102, 103)] == ["a", "a", None]
    # A re-submission is a new array: its tasks count afresh.
    assert take(sweep, 201, 1, lambda j: False, array_job=200) == "a"


def test_a_requeued_job_holds_only_the_point_it_claims_again(tmp_path):
    sweep = make_sweep(tmp_path, ["a", "b"])
    assert take(sweep, 101, 1, lambda j: True) == "a"
    # Job 101 requeued (same id): squeue says it runs, yet its claim on a is its earlier
    # attempt's and holds nothing against it. It takes b (no task yet) and gives a up.
    assert take(sweep, 101, 1, lambda j: True) == "b"
    assert not (sweep / "claims" / "a.json").exists()
    # So another task can take a while 101 runs b.
    assert take(sweep, 102, 2, lambda j: j == "101") == "a"


def test_a_requeued_job_is_one_task_of_its_point(tmp_path):
    sweep = make_sweep(tmp_path, ["a"], attempts=2)
    for restart in range(3):  # job 101 preempted and requeued twice: still one task
        assert take(sweep, 101, 1, lambda j: False) == "a", restart
    assert take(sweep, 102, 2, lambda j: False) == "a"
    assert take(sweep, 103, 3, lambda j: False) is None  # two tasks: out of tasks


def test_the_abort_switch_closes_a_point_as_the_kill_switch_does(tmp_path):
    sweep = make_sweep(tmp_path, ["a", "b"])
    (sweep / "points" / "a" / "switches" / "abort").touch()
    assert take(sweep, 101, 1, lambda j: False) == "b"
    assert closed_reason(RunDir(sweep / "points" / "a"), 3, 0) == "stopped (abort switch)"


def test_points_written_into_the_file_but_not_submitted_are_not_claimed(tmp_path):
    sweep = make_sweep(tmp_path, ["a"])
    index = json.loads((sweep / "sweep.json").read_text())
    index["points"].insert(0, {"name": "new", "overrides": {}, "attempts": 3})
    (sweep / "sweep.json").write_text(json.dumps(index))
    assert take(sweep, 101, 1, lambda j: False) == "a"


def test_main_says_what_it_took_and_what_the_throttle_is(tmp_path, capsys):
    sweep = make_sweep(tmp_path, ["a"])
    base = ["--sweep", str(sweep), "--array-job", "5", "--task", "1"]
    assert sweep_claim.main([*base, "--job", "7", "--live", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "claimed 1",
        str(sweep / "points" / "a"),
        str(sweep / "points" / "a" / "train.sbatch"),
        str(sweep / "points" / "a" / "logs" / "a-7.out"),
    ]
    # Another task while 7 runs: the point is held; once 7 has left squeue, it is free.
    assert sweep_claim.main([*base, "--job", "8", "--live", "7,8"]) == 0
    assert capsys.readouterr().out.splitlines() == ["held 1"]
    assert sweep_claim.main([*base, "--job", "8", "--live", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "claimed 1"
    # Slurm did not answer: every claim counts as live.
    assert sweep_claim.main([*base, "--job", "9", "--live-unknown"]) == 0
    assert capsys.readouterr().out.splitlines() == ["held 1"]


def test_the_claim_needs_no_package_beyond_the_standard_library():
    # It runs first in every task: jobgen's lean modules only (no pydantic, no torch).
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); import jobgen.sweep.claim"
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------- damaged and foreign files (issue 30)

DAMAGED_LINES = [
    "[1]",  # not an object
    "5",
    '{"job_id": "3", "array_job_id": "100"}',  # no point
    '{"point": "a", "job_id": "\\u00b2", "array_job_id": "100"}',  # '²': isdigit() is True, int() fails
    '{"point": "a", "job_id": "9"',  # torn
]


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_claim_line_that_cannot_be_read_is_skipped_counted_and_the_claim_goes_on(tmp_path, capsys, fmt):
    sweep = make_sweep(tmp_path, ["a", "b"], fmt=fmt)
    good = {"point": "a", "job_id": "101", "array_job_id": "100", "task": "1", "restart": 0}
    (sweep / "claims.jsonl").write_text("\n".join([DAMAGED_LINES[0], json.dumps(good), *DAMAGED_LINES[1:]]) + "\n")
    code, out, err = run_claim(sweep, 102, "101,102", capsys)
    # 101 holds nothing (no claims/a.json) but has used a task of a: b has fewer.
    assert code == 0 and out[:2] == ["claimed 2", str(point_path(sweep, "b", fmt))], (out, err)
    assert "5 line(s) skipped" in err and "claims.jsonl" in err, err
    assert claimed(sweep) == ["a", "b"]


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("damage", ["[]", "{}", '{"point": "a", "job_id": []}', "not json"])
def test_a_points_claim_file_that_cannot_be_read_does_not_free_the_point(tmp_path, capsys, damage, fmt):
    sweep = make_sweep(tmp_path, ["a", "b"], fmt=fmt)
    assert run_claim(sweep, 101, "101", capsys)[1][:2] == ["claimed 2", str(point_path(sweep, "a", fmt))]
    (sweep / "claims" / "a.json").write_text(damage)
    # claims.jsonl says 101 took a last, and 101 runs: a stays held; 102 takes b.
    code, out, err = run_claim(sweep, 102, "101,102", capsys)
    assert code == 0 and out[:2] == ["claimed 2", str(point_path(sweep, "b", fmt))] and "a.json" in err, (out, err)
    assert run_claim(sweep, 103, "101,102,103", capsys)[1] == ["held 2"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("points", [5]),
        ("points", [{"name": "../other", "overrides": {}, "program": "train", "attempts": 3}]),
        ("points", [{"name": "a", "overrides": [1, 2], "program": "train", "attempts": 3}]),
        ("points", [{"name": "a", "overrides": {}, "program": "train", "attempts": "3"}]),
        ("max_parallel", "2"),
        ("jobs", 5),
        ("jobs", [{"job_id": "\u00b2"}]),
    ],
)
@pytest.mark.parametrize("fmt", [1, 2])
def test_a_sweep_index_that_cannot_be_trusted_claims_nothing_in_one_line(tmp_path, capsys, key, value, fmt):
    sweep = make_sweep(tmp_path, ["a"], fmt=fmt)
    index = json.loads((sweep / "sweep.json").read_text())
    (sweep / "sweep.json").write_text(json.dumps({**index, key: value}))
    code, out, err = run_claim(sweep, 107, "107", capsys)
    assert code == 2 and out == [] and not (sweep / "claims.jsonl").exists(), (out, err)
    assert len(err.splitlines()) == 1 and str(sweep / "sweep.json") in err, err


def test_the_claim_derives_every_path_from_the_sweeps_directory_never_from_sweep_json(tmp_path, capsys):
    # A format-1 index (jobgen before points/) recorded each point's files; one of them now
    # names another run's. The claim runs the point where the sweep is, and a copy of the
    # sweep runs its own points.
    sweep = make_sweep(tmp_path, ["a"], fmt=1)
    other = tmp_path / "other"
    index = json.loads((sweep / "sweep.json").read_text())
    for key, path in index["points"][0].items():
        if key not in ("name", "overrides", "attempts"):
            index["points"][0][key] = path.replace(str(sweep), str(other))
    (sweep / "sweep.json").write_text(json.dumps(index))
    copy = tmp_path / "moved" / "sweep"
    copy.parent.mkdir()
    sweep.rename(copy)
    assert run_claim(copy, 107, "107", capsys)[1] == [
        "claimed 1",
        str(copy / "a"),
        str(copy / "a" / "train.sbatch"),
        str(copy / "a" / "logs" / "a-107.out"),
    ]


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_point_that_is_a_link_out_of_the_sweep_is_refused(tmp_path, capsys, fmt):
    sweep = make_sweep(tmp_path, ["a"], fmt=fmt)
    other = tmp_path / "other-run"
    point_path(sweep, "a", fmt).rename(other)
    point_path(sweep, "a", fmt).symlink_to(other)
    code, out, err = run_claim(sweep, 107, "107", capsys)
    assert code == 2 and out == [] and "symbolic link" in err and not (other / "logs").exists(), (out, err)


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("name", ["claims.jsonl", "claims"])
def test_claims_are_never_written_through_a_link(tmp_path, capsys, name, fmt):
    sweep = make_sweep(tmp_path, ["a"], fmt=fmt)
    elsewhere = tmp_path / "elsewhere"
    if name == "claims":
        elsewhere.mkdir()
    else:
        elsewhere.write_text("")
    (sweep / name).symlink_to(elsewhere)
    code, out, err = run_claim(sweep, 107, "107", capsys)
    assert code == 2 and out == [] and "symbolic link" in err, (out, err)
    assert not (any(elsewhere.iterdir()) if elsewhere.is_dir() else elsewhere.read_text())
