"""Submitting a sweep again: points matched by their overrides (a name that changed is the
same point), a base that asks Slurm for another allocation refused, a single run's directory
in the way, the array's size and throttle, and a failed sbatch that leaves everything as it
was (the failed markers it had cleared put back). sbatch and squeue are replaced to see what
the submission does around them; tests/cluster/test_slurm_sweep.py submits to real Slurm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_spec, small_sweep
from jobgen.launch.submit import SubmitError
from jobgen.slurm import client as slurm
from jobgen.slurm.client import SlurmError
from jobgen.sweep.points import load_sweep
from jobgen.sweep.submit import read_index, submit_sweep


def submit(path: Path):
    return submit_sweep(load_sweep(path), source_text=path.read_text(), skip_preflight=True)


def findings(path: Path) -> str:
    with pytest.raises(SubmitError) as info:
        submit(path)
    return "\n".join(map(str, info.value.findings))


def paths_sweep(directory: Path, extra_point: str = "") -> Path:
    (directory / "model").mkdir(exist_ok=True)
    (directory / "model2").mkdir(exist_ok=True)
    for name in ("a.jsonl", "b.jsonl"):
        (directory / name).write_text('{"instruction": "hi", "output": "hello"}\n')
    job = {"time": "2m", "exit_grace": "50s", "array": 2, "runs_root": "runs"}
    sweep = f'[sweep]\nmax_parallel = 2\npoints = [{extra_point}]\n[sweep.grid]\n"data.path" = ["a.jsonl", "b.jsonl"]\n'
    return run_spec(directory, "ds", job=job, model={"path": "model"}, data={"path": "a.jsonl"}, extra=sweep)


def test_a_point_keeps_its_directory_when_another_point_changes_the_names(tmp_path, sbatch_calls):
    submit(paths_sweep(tmp_path))
    assert [p.name for p in read_index(tmp_path / "runs" / "ds").points] == ["path-a.jsonl", "path-b.jsonl"]
    # A point with model.path: "path" is no longer one key, the file's names become
    # data.path-a.jsonl...; the sweep's points are the same points all the same.
    result = submit(paths_sweep(tmp_path, '{ "model.path" = "model2" }'))
    assert result.kept_points == ["path-a.jsonl", "path-b.jsonl"] and len(result.new_points) == 1, result
    assert sbatch_calls[-1][1] == "--array=1-6%2"  # 2 tasks for each of 3 points, not 5 points


def test_a_base_that_asks_for_another_allocation_is_refused_naming_the_points(tmp_path, sbatch_calls):
    path = small_sweep(tmp_path)
    submit(path)
    path.write_text(path.read_text().replace('time = "2m"', 'time = "3m"'))
    words = findings(path)
    assert "point lr-0.001" in words and "--time=00:02:00" in words and "--time=00:03:00" in words, words
    assert len(sbatch_calls) == 1


def test_a_single_runs_directory_is_not_taken_for_a_sweep(tmp_path, sbatch_calls):
    path = small_sweep(tmp_path)
    (tmp_path / "runs" / "lrs").mkdir(parents=True)
    (tmp_path / "runs" / "lrs" / "spec.json").write_text("{}")
    assert "single run's directory" in findings(path)


def test_the_array_holds_at_most_1000_tasks_and_starts_no_more_than_the_open_points(tmp_path, sbatch_calls):
    path = small_sweep(tmp_path)
    # The points the sweep has count too: 2 x 500 tasks submitted, 500 more for a new point.
    path.write_text(path.read_text().replace("array = 3", "array = 500"))
    submit(path)
    path.write_text(path.read_text().replace("[1e-3, 2e-3]", "[4e-3]"))
    assert "1500 tasks" in findings(path)
    path.write_text(path.read_text().replace("[4e-3]", "[1e-3, 2e-3]").replace("array = 500", "array = 3"))
    index = read_index(tmp_path / "runs" / "lrs")
    index.run(index.points[0]).done_marker.write_text("{}")
    submit(path)  # one point open: one task at a time, not max_parallel = 2
    assert sbatch_calls[-1][1] == "--array=1-500%1"  # its tasks as submitted: a point that exists is never changed


def test_a_failed_sbatch_of_a_resubmission_leaves_the_sweep_as_it_was(tmp_path, sbatch_calls, monkeypatch):
    path = small_sweep(tmp_path)
    submit(path)
    directory = tmp_path / "runs" / "lrs"
    failed = directory / "points" / "lr-0.002" / "failed"
    failed.write_text(json.dumps({"reason": "data error"}))
    before = read_index(directory)

    def refuse(script: Path, options: list[str]) -> int:
        raise SlurmError(["sbatch"], 1, "sbatch: error: invalid partition")

    monkeypatch.setattr(slurm, "sbatch", refuse)
    path.write_text(path.read_text().replace("[1e-3, 2e-3]", "[1e-3, 2e-3, 4e-3]"))
    with pytest.raises(SlurmError):
        submit(path)
    assert read_index(directory) == before and not (directory / "points" / "lr-0.004").exists()
    assert json.loads(failed.read_text()) == {"reason": "data error"}  # not queued: the failure stands


def test_a_moved_sweep_is_not_submitted_again_from_where_it_is_now(tmp_path, sbatch_calls):
    import shutil

    path = small_sweep(tmp_path)
    submit(path)
    shutil.copytree(tmp_path / "runs", tmp_path / "moved")
    path.write_text(path.read_text().replace('runs_root = "runs"', 'runs_root = "moved"'))
    words = findings(path)
    # Its points' scripts were rendered for runs/lrs: the array would run them there.
    assert "moved or copied" in words and str(tmp_path / "runs" / "lrs") in words, words
    assert len(sbatch_calls) == 1
