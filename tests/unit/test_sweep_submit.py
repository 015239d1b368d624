"""A sweep's one script (shell syntax, shellcheck, the base run's allocation with the sweep's
own name and log) and what ``submit`` writes: every new point's run directory, sweep.json,
nothing half-written when sbatch fails, and a re-submission that adds points without
changing one that exists. sbatch and squeue are replaced here only to see what the
submission does around them; tests/cluster/test_slurm_sweep.py submits to real Slurm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import small_sweep
from jobgen import slurm
from jobgen.slurm import SlurmError
from jobgen.sweep_points import load_sweep
from jobgen.sweep_render import render_sweep
from jobgen.sweep_submit import read_index, submit_sweep


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def submit(path: Path):
    return submit_sweep(load_sweep(path), source_text=path.read_text(), skip_preflight=True)


def test_the_sweep_script_asks_what_the_base_asks_with_its_own_name_and_log(workdir):
    # Shell syntax and shellcheck for each kind of site: tests/unit/test_sweep_render.py.
    sweep = load_sweep(small_sweep(workdir))
    text = render_sweep(sweep)
    directives = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert directives[:4] == [
        "--job-name=lrs",
        f"--chdir={sweep.directory}",
        f"--output={sweep.directory}/logs/%x-%A_%a.out",
        "--open-mode=append",
    ]
    assert "--time=00:02:00" in directives and not any(d.startswith("--array") for d in directives)
    assert "py_on_head python -m jobgen.sweep_claim" in text and 'exec bash "$POINT_SCRIPT"' in text


def test_submit_writes_every_point_and_the_index_then_one_array(workdir, sbatch_calls):
    result = submit(small_sweep(workdir))
    directory = workdir / "runs" / "lrs"
    assert result.job_id == 101 and result.new_points == ["lr-0.001", "lr-0.002"]
    assert sbatch_calls == [[str(directory / "sweep.sbatch"), "--array=1-6%2"]]  # job.array tasks per point
    index = read_index(directory)
    assert [p["name"] for p in index["points"]] == ["lr-0.001", "lr-0.002"]
    assert index["jobs"][0]["job_id"] == 101
    for point in index["points"]:
        spec = json.loads((Path(point["dir"]) / "spec.json").read_text())
        assert spec["run"]["train"]["lr"] == point["overrides"]["train.lr"]
        assert Path(point["script"]).is_file() and point["attempts"] == 3


def test_a_failed_sbatch_leaves_no_point_and_no_index(workdir, monkeypatch):
    def refuse(script: Path, options: list[str]) -> int:
        raise SlurmError(["sbatch"], 1, "sbatch: error: invalid partition")

    monkeypatch.setattr(slurm, "sbatch", refuse)
    with pytest.raises(SlurmError):
        submit(small_sweep(workdir))
    directory = workdir / "runs" / "lrs"
    assert not (directory / "sweep.json").exists()
    assert not list(directory.glob("lr-*"))


def test_resubmitting_adds_new_points_and_never_changes_one_that_exists(workdir, sbatch_calls):
    path = small_sweep(workdir)
    submit(path)
    directory = workdir / "runs" / "lrs"
    finished = directory / "lr-0.001"
    (finished / "done").write_text("")
    spec_before = (finished / "spec.json").read_text()
    # The file gains a point, and its base changes in a way the existing points would show.
    path.write_text(path.read_text().replace('"train.lr" = [1e-3, 2e-3]', '"train.lr" = [1e-3, 2e-3, 4e-3]'))
    result = submit(path)
    assert result.new_points == ["lr-0.004"] and result.kept_points == ["lr-0.001", "lr-0.002"]
    assert (finished / "spec.json").read_text() == spec_before
    # The finished point takes no task: 3 for the unfinished one, 3 for the new one.
    assert sbatch_calls[-1][1] == "--array=1-6%2"
    assert [p["name"] for p in read_index(directory)["points"]] == ["lr-0.001", "lr-0.002", "lr-0.004"]
    assert [j["job_id"] for j in read_index(directory)["jobs"]] == [101, 102]


def test_a_sweep_with_every_point_finished_is_not_queued(workdir, sbatch_calls):
    from jobgen.submit import SubmitError

    path = small_sweep(workdir)
    submit(path)
    for point in read_index(workdir / "runs" / "lrs")["points"]:
        Path(point["done"]).write_text("")
    with pytest.raises(SubmitError) as info:
        submit(path)
    assert "nothing to run" in str(info.value.findings)
    assert len(sbatch_calls) == 1


def test_resubmitting_keeps_the_array_off_the_nodes_its_points_quarantined(workdir, sbatch_calls):
    from jobgen import quarantine
    from jobgen.rundir import RunDir

    path = small_sweep(workdir)
    submit(path)
    directory = workdir / "runs" / "lrs"
    quarantine.add(RunDir(directory / "lr-0.001"), {"node2": "silent ranks"}, "101_1")
    quarantine.add(RunDir(directory / "lr-0.002"), {"node3": "Slurm marked it down"}, "101_2")
    submit(path)
    assert sbatch_calls[-1][1:] == ["--array=1-6%2", "--exclude=node2,node3"]
