"""A crash that will repeat stops the run (issue 30, item 10): when two tasks of a run in a row
crash the same way (the same exception, raised at the same place, at the same step), rank 0
writes the ``failed`` marker, so the array's queued tasks do not start; a crash followed by a
different one does not stop it. A crash building the model that is an error of the code, not
of the machine, stops it in the first task (issue 32). Under torchrun on gloo with two ranks: the crash is planted in
every rank's optimizer step through a sitecustomize module, the array tasks are told apart by
their Slurm ids, as the batch script gives them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import PLANTED_CRASHES, REPO, fault_dir, jobgen, make_run, torchrun
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch


def task(run: Path, plant: Path, job_id: int, array_job_id: int = 500, **crash: str):
    """One array task of the run: the trainer on two gloo ranks with the job's Slurm ids."""
    env = {
        "PYTHONPATH": f"{plant}:{REPO}",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_ARRAY_JOB_ID": str(array_job_id),
        "SLURM_ARRAY_TASK_ID": str(job_id - array_job_id),
        "SLURM_RESTART_COUNT": "0",
        **crash,
    }
    return torchrun(run, nproc=2, env=env, timeout=300)


@pytest.fixture()
def plant(tmp_path: Path) -> Path:
    return fault_dir(tmp_path, PLANTED_CRASHES)


def test_the_same_crash_in_two_tasks_in_a_row_stops_the_run(tmp_path: Path, tiny_model: Path, plant: Path):
    run = make_run(tmp_path, tiny_model, "same", max_steps=20)
    first = task(run, plant, 501, CRASH_AT="3")
    assert first.returncode != 0, first.stdout[-2000:]
    assert not (run / "failed").exists(), "one crash is no evidence that it repeats"

    second = task(run, plant, 502, CRASH_AT="3")
    assert second.returncode != 0
    marker = json.loads((run / "failed").read_text())
    assert marker["exit_code"] == ExitCode.CRASHED and marker["job_id"] == "502"
    assert marker["reason"].startswith("crashed twice the same way at step 2 (ValueError at sitecustomize.py:"), marker
    assert "a planted crash" in marker["reason"] and "jobgen logs" in marker["fix"]
    exit_record = (run / "logs" / "exit-code.502.0").read_text().splitlines()
    assert exit_record[0] == str(int(ExitCode.CRASHED)) and "crashed twice the same way" in exit_record[1]

    # status says why the run stopped, and the next task does not start.
    shown = jobgen("status", str(run), check=False).stdout
    assert "crashed twice the same way at step 2" in shown, shown
    task(run, plant, 503)
    assert (run / "logs" / "exit-code.503.0").read_text().splitlines()[0] == str(int(ExitCode.NOT_STARTED))


def test_an_error_of_the_code_while_building_the_model_stops_the_run_at_once(
    tmp_path: Path, tiny_model: Path, plant: Path
):
    """Issue 32: an exit-1 crash before the first step that every task would meet (an
    AttributeError building the model) writes the failed marker in the first task; the next
    task does not start."""
    run = make_run(tmp_path, tiny_model, "build", max_steps=20)
    first = task(run, plant, 801, CRASH_BUILD="code")
    assert first.returncode != 0
    marker = json.loads((run / "failed").read_text())
    assert marker["exit_code"] == ExitCode.CRASHED and marker["job_id"] == "801", marker
    assert marker["reason"].startswith("crashed before its first step (AttributeError at sitecustomize.py:"), marker
    assert "as every task would" in marker["reason"] and "intermediate_size" in marker["reason"], marker
    task(run, plant, 802)
    assert (run / "logs" / "exit-code.802.0").read_text().splitlines()[0] == str(int(ExitCode.NOT_STARTED))


def test_an_error_of_the_world_while_building_the_model_does_not_stop_the_run(
    tmp_path: Path, tiny_model: Path, plant: Path
):
    """An I/O error building the model may not meet the next task (other nodes, a file system
    back): no marker from one; the run trains on in the next task."""
    run = make_run(tmp_path, tiny_model, "world", max_steps=2)
    assert task(run, plant, 901, CRASH_BUILD="io").returncode != 0
    assert not (run / "failed").exists()
    assert task(run, plant, 902).returncode == 0
    assert (run / "done").exists()


def test_a_crash_followed_by_another_kind_does_not_stop_the_run(tmp_path: Path, tiny_model: Path, plant: Path):
    run = make_run(tmp_path, tiny_model, "other", max_steps=20)
    assert task(run, plant, 601, CRASH_AT="3").returncode != 0
    assert task(run, plant, 602, CRASH_AT="3", CRASH_KIND="key").returncode != 0
    assert not (run / "failed").exists()
    # Nor does the same crash again after a resubmission (another array job): it starts afresh.
    assert task(run, plant, 611, array_job_id=610, CRASH_AT="3", CRASH_KIND="key").returncode != 0
    assert not (run / "failed").exists()


@pytest.mark.parametrize(
    "case",
    ["lora-targets", "pipeline-split"],
)
def test_a_model_the_spec_cannot_build_stops_the_run_as_a_model_error(tmp_path: Path, tiny_model: Path, case: str):
    """What validate refuses for a local model, when it reaches the trainer anyway (a spec.json
    written before the check, a model changed since): peft's and the pipeline split's typed
    errors are a model error, which every task would repeat."""
    if case == "lora-targets":
        run = make_run(tmp_path, tiny_model, "lora", model={"lora": {"r": 4, "target_modules": ["q_proj"]}})
        edit = ("model", "lora", "target_modules"), ["no_such_proj"]
    else:
        run = make_run(tmp_path, tiny_model, "pipe", parallelism="pipeline", micro_batch_size=4, grad_accum=1)
        edit = ("train", "pipeline", "layers_per_stage"), [1, 2]  # the tiny model has 2 blocks
    spec = json.loads((run / "spec.json").read_text())
    *path, key = edit[0]
    table = spec["run"]
    for name in path:
        table = table[name]
    table[key] = edit[1]
    (run / "spec.json").write_text(json.dumps(spec))

    proc = task(run, tmp_path, 701)
    assert proc.returncode != 0
    marker = json.loads((run / "failed").read_text())
    assert marker["exit_code"] == ExitCode.MODEL_ERROR, marker
    expected = "NoMatchingPeftModuleError" if case == "lora-targets" else "PipelineSplitError"
    assert marker["reason"].startswith(expected), marker
