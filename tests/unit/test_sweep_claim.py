"""jobgen.sweep_claim: which point an array task of a sweep runs. The points' files are
fabricated; which jobs are alive is the test's (tests/cluster/test_slurm_sweep.py runs the
claim in real Slurm tasks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobgen import sweep_claim
from jobgen.sweep_claim import choose, claim, closed_reason, parse_args, read_claims


def make_sweep(tmp_path: Path, names: list[str], *, attempts: int = 3, max_parallel: int = 2) -> Path:
    sweep = tmp_path / "sweep"
    points = []
    for name in names:
        run = sweep / name
        (run / "switches").mkdir(parents=True)
        points.append(
            {
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
        )
    (sweep / "sweep.json").write_text(
        json.dumps({"format": 1, "name": "s", "max_parallel": max_parallel, "points": points})
    )
    return sweep


def args(job: int, task: int, array_job: int = 100, wait: float = 0.0):
    return parse_args(
        ["--sweep", "x", "--job", str(job), "--array-job", str(array_job), "--task", str(task), "--wait", str(wait)]
    )


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(sweep_claim, "set_throttle", lambda *a: calls.append(list(a)))
    monkeypatch.setattr(sweep_claim, "POLL_S", 0.01)
    return calls


def test_tasks_take_the_points_in_turn_and_never_one_held_by_a_live_task(tmp_path, no_slurm):
    sweep = make_sweep(tmp_path, ["a", "b", "c"])
    alive = {"101", "102"}
    taken = [claim(sweep, args(job, job - 100), alive=lambda j: j in alive)["name"] for job in (101, 102, 103)]
    assert taken == ["a", "b", "c"]
    # 101 ended (its limit): the next task takes the point with the fewest tasks that is free.
    alive = {"102", "103"}
    assert claim(sweep, args(104, 4), alive=lambda j: j in alive)["name"] == "a"
    assert [c["point"] for c in read_claims(sweep)] == ["a", "b", "c", "a"]
    # The throttle follows the points still open: three, so K = 2.
    assert no_slurm[-1] == ["100", 3, 2]


def test_closed_points_are_skipped_and_the_throttle_drops_to_what_is_left(tmp_path, no_slurm):
    sweep = make_sweep(tmp_path, ["a", "b", "c", "d"])
    (sweep / "a" / "done").touch()
    (sweep / "b" / "failed").write_text("{}")
    (sweep / "c" / "switches" / "kill").touch()
    point = claim(sweep, args(101, 1), alive=lambda j: False)
    assert point["name"] == "d"
    assert no_slurm[-1] == ["100", 1, 2]
    (sweep / "d" / "done").touch()
    assert claim(sweep, args(102, 2), alive=lambda j: False) is None
    assert no_slurm[-1] == ["100", 0, 2]  # nothing open: the pending tasks are cancelled


def test_a_link_named_kill_does_not_stop_a_point(tmp_path):
    sweep = make_sweep(tmp_path, ["a"])
    (sweep / "a" / "switches" / "kill").symlink_to(tmp_path / "elsewhere")
    point = json.loads((sweep / "sweep.json").read_text())["points"][0]
    assert closed_reason(point, 0) is None


def test_a_point_out_of_tasks_in_this_array_gets_new_ones_in_the_next(tmp_path):
    sweep = make_sweep(tmp_path, ["a"], attempts=2)
    for job in (101, 102):
        assert claim(sweep, args(job, job - 100), alive=lambda j: False)["name"] == "a"
    assert claim(sweep, args(103, 3), alive=lambda j: False) is None
    # A re-submission is a new array: its tasks count afresh.
    assert claim(sweep, args(201, 1, array_job=200), alive=lambda j: False)["name"] == "a"


def test_a_requeued_job_reclaims_the_point_its_earlier_attempt_held(tmp_path):
    sweep = make_sweep(tmp_path, ["a", "b"])
    assert claim(sweep, args(101, 1), alive=lambda j: True)["name"] == "a"
    # Same job id after a requeue: squeue says it runs (it is this attempt), yet its claim
    # is from an earlier attempt and holds nothing against it.
    index = json.loads((sweep / "sweep.json").read_text())
    point, open_points, held = choose(sweep, index, "101", "100", alive=lambda j: True)
    assert (point["name"], open_points, held) == ("b", 2, 0)  # fewest tasks first: b has none


def test_a_task_waits_for_a_point_whose_task_is_ending_then_gives_up(tmp_path):
    sweep = make_sweep(tmp_path, ["a"])
    claim(sweep, args(101, 1), alive=lambda j: True)
    answers = iter([True, True, False])
    got = claim(sweep, args(102, 2, wait=5), alive=lambda j: next(answers))
    assert got["name"] == "a"
    # Held for good: after the wait, nothing.
    assert claim(sweep, args(103, 3, wait=0.05), alive=lambda j: True) is None


def test_points_written_into_the_file_but_not_submitted_are_not_claimed(tmp_path):
    sweep = make_sweep(tmp_path, ["a"])
    index = json.loads((sweep / "sweep.json").read_text())
    index["points"].insert(0, {"name": "new", "overrides": {}})
    (sweep / "sweep.json").write_text(json.dumps(index))
    assert claim(sweep, args(101, 1), alive=lambda j: False)["name"] == "a"


def test_main_prints_the_point_its_script_and_its_log(tmp_path, capsys):
    sweep = make_sweep(tmp_path, ["a"])
    assert sweep_claim.main(["--sweep", str(sweep), "--job", "7", "--array-job", "5", "--task", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [str(sweep / "a"), str(sweep / "a" / "train.sbatch"), str(sweep / "a" / "logs" / "a-7.out")]


def test_the_claim_needs_no_package_beyond_the_standard_library():
    # It runs before the job's environment is set up: on a container site, with the node's python3.
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); import jobgen.sweep_claim"
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
