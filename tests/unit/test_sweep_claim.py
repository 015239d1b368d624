"""jobgen.sweep_claim: which point an array task of a sweep runs, and the throttle it asks
for. The points' files are fabricated; which jobs are alive is the test's (the batch script
asks squeue: tests/cluster/test_slurm_sweep.py runs the claim in real Slurm tasks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jobgen import sweep_claim
from jobgen.sweep_claim import claim, closed_reason, parse_args, read_claims


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


def args(job: int, task: int, array_job: int = 100):
    return parse_args(
        ["--sweep", "x", "--job", str(job), "--array-job", str(array_job), "--task", str(task), "--live-unknown"]
    )


def take(sweep: Path, job: int, task: int, alive, array_job: int = 100) -> str | None:
    point, _, _ = claim(sweep, args(job, task, array_job), alive)
    return point["name"] if point else None


def test_tasks_take_the_points_in_turn_and_never_one_held_by_a_live_task(tmp_path):
    sweep = make_sweep(tmp_path, ["a", "b", "c"])
    alive = {"101", "102"}
    assert [take(sweep, job, job - 100, lambda j: j in alive) for job in (101, 102, 103)] == ["a", "b", "c"]
    # 101 ended (its limit): the next task takes the point with the fewest tasks that is free.
    alive = {"102", "103"}
    point, throttle, held = claim(sweep, args(104, 4), lambda j: j in alive)
    assert (point["name"], throttle, held) == ("a", 2, 2)  # three points open: the throttle is K = 2
    assert [c["point"] for c in read_claims(sweep)] == ["a", "b", "c", "a"]


def test_closed_points_are_skipped_and_the_throttle_drops_to_what_is_left(tmp_path):
    sweep = make_sweep(tmp_path, ["a", "b", "c", "d"])
    (sweep / "a" / "done").touch()
    (sweep / "b" / "failed").write_text("{}")
    (sweep / "c" / "switches" / "kill").touch()
    point, throttle, _ = claim(sweep, args(101, 1), lambda j: False)
    assert (point["name"], throttle) == ("d", 1)
    (sweep / "d" / "done").touch()
    assert claim(sweep, args(102, 2), lambda j: False) == (None, 0, 0)  # nothing open: cancel the rest


def test_a_link_named_kill_does_not_stop_a_point(tmp_path):
    sweep = make_sweep(tmp_path, ["a"])
    (sweep / "a" / "switches" / "kill").symlink_to(tmp_path / "elsewhere")
    point = json.loads((sweep / "sweep.json").read_text())["points"][0]
    assert closed_reason(point, 0) is None


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
    (sweep / "a" / "switches" / "abort").touch()
    assert take(sweep, 101, 1, lambda j: False) == "b"
    point = json.loads((sweep / "sweep.json").read_text())["points"][0]
    assert closed_reason(point, 0) == "stopped (abort switch)"


def test_points_written_into_the_file_but_not_submitted_are_not_claimed(tmp_path):
    sweep = make_sweep(tmp_path, ["a"])
    index = json.loads((sweep / "sweep.json").read_text())
    index["points"].insert(0, {"name": "new", "overrides": {}})
    (sweep / "sweep.json").write_text(json.dumps(index))
    assert take(sweep, 101, 1, lambda j: False) == "a"


def test_main_says_what_it_took_and_what_the_throttle_is(tmp_path, capsys):
    sweep = make_sweep(tmp_path, ["a"])
    base = ["--sweep", str(sweep), "--array-job", "5", "--task", "1"]
    assert sweep_claim.main([*base, "--job", "7", "--live", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "claimed 1",
        str(sweep / "a"),
        str(sweep / "a" / "train.sbatch"),
        str(sweep / "a" / "logs" / "a-7.out"),
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
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); import jobgen.sweep_claim"
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
