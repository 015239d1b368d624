"""Run directories are created whole or not at all, and continued, never clobbered."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

import jobgen.runs.materialize as materialize_mod
from helpers import run_spec
from jobgen.launch.render import render
from jobgen.runs.materialize import materialize
from jobgen.runs.rundir import (
    STARTUP_SWITCHES,
    SWITCHES,
    RunDir,
    RunDirError,
    checkpoint_name,
    checkpoint_step,
    find_run,
)
from jobgen.spec.loader import load_run


@pytest.fixture()
def spec_file(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text("{}\n")
    return run_spec(
        tmp_path, "sft", job={"time": "1h", "runs_root": "runs"}, model={"path": "model"}, data={"path": "data.jsonl"}
    )


def test_new_run_directory_layout(spec_file: Path):
    spec = load_run(spec_file)
    run, created = materialize(spec, render(spec), spec_file.read_text())
    assert created and run.path == spec_file.parent / "runs" / "sft"
    for sub in ("switches", "logs", "checkpoints", "repro", "history"):
        assert (run.path / sub).is_dir()
    assert json.loads(run.spec_file.read_text())["run"]["job"]["name"] == "sft"
    assert (run.path / "run.toml").read_text() == spec_file.read_text()
    assert os.access(run.path / "train.sbatch", os.X_OK)
    mode = stat.S_IMODE((run.path / "switches").stat().st_mode)
    assert mode & 0o020 and mode & stat.S_ISGID  # group-writable, setgid
    assert [p.name for p in run.path.parent.iterdir()] == ["sft"]  # no staging left


def test_failure_mid_creation_leaves_nothing(spec_file: Path, monkeypatch: pytest.MonkeyPatch):
    spec = load_run(spec_file)
    real = materialize_mod.write_text_atomic

    def failing(path, text, mode=0o644):
        if str(path).endswith(".sbatch"):
            raise OSError(28, "No space left on device")
        return real(path, text, mode)

    monkeypatch.setattr(materialize_mod, "write_text_atomic", failing)
    with pytest.raises(OSError):
        materialize(spec, render(spec), "x")
    assert list((spec_file.parent / "runs").iterdir()) == []


def test_resubmit_continues_and_keeps_checkpoints(spec_file: Path):
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    (run.path / "checkpoints" / "step-10").mkdir()
    (run.path / "logs" / "old.out").write_text("old")
    longer = spec_file.read_text().replace('time = "1h"', 'time = "2h"')
    spec_file.write_text(longer)
    spec2 = load_run(spec_file)
    run2, created = materialize(spec2, render(spec2), longer)
    assert not created and run2.path == run.path
    assert (run.path / "checkpoints" / "step-10").is_dir() and (run.path / "logs" / "old.out").exists()
    assert "--time=02:00:00" in (run.path / "train.sbatch").read_text()
    history = list((run.path / "history").glob("spec-*.json"))
    assert len(history) == 1 and json.loads(history[0].read_text())["run"]["job"]["time"] == "1h"


def test_resubmit_with_another_model_is_refused_once_a_checkpoint_exists(spec_file: Path, tmp_path: Path):
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), None)
    (run.checkpoints / "step-00000010").mkdir()
    before = run.spec_file.read_text()
    (tmp_path / "model2").mkdir()
    spec_file.write_text(spec_file.read_text().replace('path = "model"', 'path = "model2"'))
    spec2 = load_run(spec_file)
    with pytest.raises(RunDirError, match=r"different \[model\]"):
        materialize(spec2, render(spec2), None)
    assert run.spec_file.read_text() == before


@pytest.mark.parametrize("left", ["nothing", "a save cut short"])
def test_a_run_fixed_before_its_first_checkpoint_may_be_submitted_again(spec_file: Path, tmp_path: Path, left):
    """Issue 46: a run that failed on a wrong data path (no checkpoint yet) is fixed and submitted
    again, as jobgen status advises; it was refused for a different [data] its checkpoints, which
    did not exist, would not fit."""
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), None)
    if left == "a save cut short":
        (run.checkpoints / ".tmp-step-00000002").mkdir()
    (tmp_path / "fixed.jsonl").write_text("{}\n")
    spec_file.write_text(spec_file.read_text().replace('"data.jsonl"', '"fixed.jsonl"'))
    spec2 = load_run(spec_file)
    _, created = materialize(spec2, render(spec2), None)
    assert not created and json.loads(run.spec_file.read_text())["run"]["data"]["path"].endswith("fixed.jsonl")
    [history] = (run.path / "history").iterdir()
    assert json.loads(history.read_text())["run"]["data"]["path"].endswith("data.jsonl")


def test_existing_foreign_directory_is_not_touched(spec_file: Path):
    spec = load_run(spec_file)
    spec.run_dir.mkdir(parents=True)
    (spec.run_dir / "precious.txt").write_text("mine")
    with pytest.raises(RunDirError, match="not a jobgen run directory"):
        materialize(spec, render(spec), None)
    assert [p.name for p in spec.run_dir.iterdir()] == ["precious.txt"]


def test_switches_and_lookup(spec_file: Path):
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), None)
    assert find_run("sft", spec.runs_root).path == run.path
    assert find_run(str(run.path), None).path == run.path
    with pytest.raises(RunDirError):
        find_run("nope", spec.runs_root)
    target, created = run.set_switch("kill")
    assert created and target == run.switches / "kill" and "uid" in target.read_text()
    with pytest.raises(ValueError):
        run.set_switch("reboot")


def test_jobs_record_is_appended(spec_file: Path):
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), None)
    run.record_job({"job_id": 1})
    run.record_job({"job_id": 2, "after": 1})
    assert [j["job_id"] for j in RunDir(run.path).jobs()] == [1, 2]


def test_checkpoint_names_are_parsed_in_one_place(tmp_path: Path):
    run = RunDir(tmp_path)
    for name in (
        checkpoint_name(120),
        checkpoint_name(7),
        "step-5x",
        ".tmp-step-00000130",
        "broken-step-00000110-20260101T000000",
        "step-²",
    ):
        (run.checkpoints / name).mkdir(parents=True)
    (run.checkpoints / "step-00000200").write_text("a file, not a checkpoint")
    (run.checkpoints / "latest").write_text("step-00000120\n")
    assert checkpoint_name(120) == "step-00000120" and checkpoint_step("step-00000120") == 120
    assert [checkpoint_step(n) for n in ("latest", "step-", "step-5x", "step-²", ".tmp-step-1")] == [None] * 5
    assert run.complete_checkpoints() == [
        (7, run.checkpoints / "step-00000007"),
        (120, run.checkpoints / "step-00000120"),
    ]
    assert [p.name for p in run.broken_checkpoints()] == ["broken-step-00000110-20260101T000000"]


def test_names_with_a_job_id_and_restart(tmp_path: Path):
    run = RunDir(tmp_path)
    assert run.stop_request(7, 2) == tmp_path / "switches" / "stop.7.2"
    assert run.stop_request(7, 2).name.startswith(run.stop_request_stem(7).name + ".")
    assert run.exit_code_file("7", 0) == tmp_path / "logs" / "exit-code.7.0"
    assert run.batch_log("sft", 7) == tmp_path / "logs" / "sft-7.out"
    assert run.node_log("sft", 7, "node1") == tmp_path / "logs" / "sft-7-node1.out"
    assert run.switch("abort") == tmp_path / "switches" / "abort" and set(STARTUP_SWITCHES) <= set(SWITCHES)
    with pytest.raises(ValueError):
        run.switch("stop.7.2")
