"""A sweep's one script (shell syntax, shellcheck, the base run's allocation with the sweep's
own name and log) and what ``submit`` writes: every new point's run directory, sweep.json,
nothing half-written when sbatch fails, and a re-submission that adds points without
changing one that exists. sbatch and squeue are replaced here only to see what the
submission does around them; tests/cluster/test_slurm_sweep.py submits to real Slurm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_spec, small_sweep
from jobgen.slurm import client as slurm
from jobgen.slurm.client import SlurmError
from jobgen.sweep import claim as sweep_claim
from jobgen.sweep.points import load_sweep
from jobgen.sweep.render import render_sweep
from jobgen.sweep.submit import read_index, submit_sweep


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
    assert "py_on_head python -m jobgen.sweep.claim" in text and 'exec bash "$POINT_SCRIPT"' in text


def test_submit_writes_every_point_and_the_index_then_one_array(workdir, sbatch_calls):
    result = submit(small_sweep(workdir))
    directory = workdir / "runs" / "lrs"
    assert result.job_id == 101 and result.new_points == ["lr-0.001", "lr-0.002"]
    assert sbatch_calls == [[str(directory / "sweep.sbatch"), "--array=1-6%2"]]  # job.array tasks per point
    index = read_index(directory)
    assert [p.name for p in index.points] == ["lr-0.001", "lr-0.002"]
    assert [job.job_id for job in index.jobs] == [101]
    for point in index.points:
        run = index.run(point)
        assert run.path == directory / "points" / point.name
        spec = json.loads(run.spec_file.read_text())
        assert spec["run"]["train"]["lr"] == point.overrides["train.lr"]
        assert run.script(point.program).is_file() and point.attempts == 3
    # What sweep.json records of a point: what it is, never where (that is derived).
    entry = json.loads((directory / "sweep.json").read_text())["points"][0]
    assert entry == {"name": "lr-0.001", "overrides": {"train.lr": 0.001}, "program": "train", "attempts": 3}


def test_a_failed_sbatch_leaves_no_point_and_no_index(workdir, monkeypatch):
    def refuse(script: Path, options: list[str]) -> int:
        raise SlurmError(["sbatch"], 1, "sbatch: error: invalid partition")

    monkeypatch.setattr(slurm, "sbatch", refuse)
    with pytest.raises(SlurmError):
        submit(small_sweep(workdir))
    directory = workdir / "runs" / "lrs"
    assert not (directory / "sweep.json").exists()
    assert not list(directory.glob("points/lr-*"))


def test_resubmitting_adds_new_points_and_never_changes_one_that_exists(workdir, sbatch_calls):
    path = small_sweep(workdir)
    submit(path)
    directory = workdir / "runs" / "lrs"
    finished = directory / "points" / "lr-0.001"
    (finished / "done").write_text("")
    spec_before = (finished / "spec.json").read_text()
    # The file gains a point, and its base changes in a way the existing points would show.
    path.write_text(path.read_text().replace('"train.lr" = [1e-3, 2e-3]', '"train.lr" = [1e-3, 2e-3, 4e-3]'))
    result = submit(path)
    assert result.new_points == ["lr-0.004"] and result.kept_points == ["lr-0.001", "lr-0.002"]
    assert (finished / "spec.json").read_text() == spec_before
    # The finished point takes no task: 3 for the unfinished one, 3 for the new one.
    assert sbatch_calls[-1][1] == "--array=1-6%2"
    assert [p.name for p in read_index(directory).points] == ["lr-0.001", "lr-0.002", "lr-0.004"]
    assert [j.job_id for j in read_index(directory).jobs] == [101, 102]


def test_a_sweep_with_every_point_finished_is_not_queued(workdir, sbatch_calls):
    from jobgen.launch.submit import SubmitError

    path = small_sweep(workdir)
    submit(path)
    index = read_index(workdir / "runs" / "lrs")
    for point in index.points:
        index.run(point).done_marker.write_text("")
    with pytest.raises(SubmitError) as info:
        submit(path)
    assert "nothing to run" in str(info.value.findings)
    assert len(sbatch_calls) == 1


def test_resubmitting_keeps_the_array_off_the_nodes_its_points_quarantined(workdir, sbatch_calls):
    from jobgen.runs import quarantine
    from jobgen.runs.rundir import RunDir

    path = small_sweep(workdir)
    submit(path)
    directory = workdir / "runs" / "lrs"
    quarantine.add(RunDir(directory / "points" / "lr-0.001"), {"node2": "silent ranks"}, "101_1")
    quarantine.add(RunDir(directory / "points" / "lr-0.002"), {"node3": "Slurm marked it down"}, "101_2")
    submit(path)
    assert sbatch_calls[-1][1:] == ["--array=1-6%2", "--exclude=node2,node3"]


def test_points_named_as_the_sweeps_own_files_live_where_no_sweep_file_can(workdir, sbatch_calls, capsys):
    # The short key "__" is stripped from the names ('__-sweep.json' -> 'sweep.json'): four
    # points named as the sweep's index, its claims, its logs and its script.
    (workdir / "model").mkdir()
    (workdir / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    names = ["sweep.json", "claims.jsonl", "logs", "sweep.sbatch"]
    grid = '[sweep]\nmax_parallel = 4\n[sweep.grid]\n"env.__" = ' + json.dumps(names) + "\n"
    job = {"time": "2m", "exit_grace": "50s", "array": 1, "runs_root": "runs"}
    path = run_spec(workdir, "lrs", job=job, model={"path": "model"}, data={"path": "data.jsonl"}, extra=grid)
    assert [p.name for p in load_sweep(path).points] == names
    submit(path)
    directory = workdir / "runs" / "lrs"
    assert [p["name"] for p in json.loads((directory / "sweep.json").read_text())["points"]] == names
    assert (directory / "sweep.sbatch").is_file()
    # Every task of the array claims a point, each a different one, and the claims are kept.
    taken = []
    for job_id in (201, 202, 203, 204):
        argv = ["--sweep", str(directory), "--job", str(job_id), "--array-job", "200", "--task", "1"]
        assert sweep_claim.main([*argv, "--live", str(job_id)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("claimed "), out
        taken.append(Path(out[1]).name)
        assert (Path(out[1]) / "spec.json").is_file() and Path(out[2]).is_file(), out
    assert sorted(taken) == sorted(names)
    lines = (directory / "claims.jsonl").read_text().splitlines()
    assert [json.loads(line)["point"] for line in lines] == taken
