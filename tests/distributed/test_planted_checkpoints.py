"""A checkpoint a teammate planted a pickle in runs nothing, whoever reads it (issue 30).

Each kind of checkpoint the trainer writes (full fine-tuning under DDP, a pipeline, LoRA,
optimizer in backward under FSDP) trains 3 steps under torchrun (the four in one), saving each. Step 1 is
left alone; step 2 gets a planted non-tensor item in a shard (a ``torch.save`` of an object
that unpickles as ``os.system``); step 3 a planted ``.metadata`` (``os.system`` by name); and
``checkpoints/step-00000009`` is a link to a copy of step 1 outside the run. Then the real
paths, each of which ran the payload before:

- ``jobgen export RUN``: step 3 is skipped with the refusal's one line and step 2 exported
  (an export reads tensors only); the link is not this run's checkpoint and is not taken.
- ``jobgen export RUN --best`` (best.json naming step 3) and ``jobgen serve RUN --local
  --step 3``: exit status 2 and one line naming the file, no traceback, no server.
- resume (asked for a 4th step): steps 3 and 2 are set aside with the refusal in
  broken.json, step 1 loads, the run ends at step 4.

The marker file the payloads would create never appears.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import DATA, TRAINER_SETTINGS, jobgen, run_spec, summary, torchrun, torchrun_many
from planted import plant_item, plant_metadata

pytestmark = pytest.mark.torch

PIPELINE = {"parallelism": "pipeline", "pipeline": {"schedule": "interleaved-1f1b", "microbatches": 2}}
OPTIMIZER_IN_BACKWARD = {"parallelism": "fsdp", "optimizer_in_backward": True, "grad_accum": 1, "grad_clip": 0}
# kind -> (deep model?, [model] keys, [train] keys)
KINDS = {
    "train": (False, {}, {}),
    "pipeline": (True, {}, PIPELINE),
    "lora": (False, {"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}, {}),
    "optimizer_in_backward": (False, {}, OPTIMIZER_IN_BACKWARD),
}


def _name(step: int) -> str:
    return f"step-{step:08d}"


def _run(directory: Path, kind: str, model_path: Path) -> Path:
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    _, model, train = KINDS[kind]
    spec_file = run_spec(
        directory,
        kind.replace("_", "-"),
        site={"profile": "local", "slurm": {"cpus_per_node": 4}},
        job={"time": "1h", "runs_root": "runs", "nodes": 1, "procs_per_node": 2},
        model={"path": model_path, "dtype": "float32", **model},
        data={"path": DATA, "max_length": 128},
        train={**TRAINER_SETTINGS, "max_steps": 3, "save_every_steps": 1, "keep_checkpoints": 5, **train},
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run.path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, deep_model) -> dict[str, Path]:
    """One run of each kind, trained 3 steps, all in one torchrun (tests/run_many.py): a start-up
    of torch per kind would cost more than the training."""
    runs = {
        kind: _run(tmp_path_factory.mktemp(kind), kind, deep_model if KINDS[kind][0] else tiny_model) for kind in KINDS
    }
    proc = torchrun_many(list(runs.values()), nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return runs


@pytest.fixture(scope="module", params=list(KINDS))
def planted(request, trained: dict[str, Path]) -> tuple[Path, Path]:
    """A trained run of one kind with its checkpoints planted as the module docstring says,
    and the marker its payloads would create."""
    run = trained[request.param]
    directory = run.parent.parent  # the kind's own directory, holding runs/
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == [_name(1), _name(2), _name(3)]
    marker = directory / "pwned"
    plant_item(checkpoints / _name(2), marker)
    plant_metadata(checkpoints / _name(3), marker)
    other = shutil.copytree(checkpoints / _name(1), directory / "other" / "checkpoints" / _name(1))
    (checkpoints / _name(9)).symlink_to(other)
    (checkpoints / "best.json").write_text(json.dumps({"step": 3, "checkpoint": _name(3), "eval_loss": 1.0}))
    return run, marker


def _refusal(run: Path, step: int) -> str:
    return f"refusing to load {run}/checkpoints/{_name(step)}/.metadata: it asks for os.system"


def _one_line(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
    return out.strip()


def test_export_skips_the_planted_checkpoint_and_takes_no_other_runs(planted, tmp_path):
    run, marker = planted
    proc = jobgen("export", str(run), "--to", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"jobgen export: skipped {_name(3)}: {_refusal(run, 3)}" in proc.stderr, proc.stderr
    assert f"exported {_name(2)} of {run}" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr and not marker.exists()


def test_export_best_names_the_refused_file_in_one_line(planted, tmp_path):
    run, marker = planted
    line = _one_line(jobgen("export", str(run), "--to", str(tmp_path / "hf"), "--best"))
    assert line == f"jobgen export: checkpoint {_name(3)} could not be loaded ({_name(3)}: {_refusal(run, 3)})"
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_serve_refuses_before_any_server_starts(planted):
    run, marker = planted
    line = _one_line(jobgen("serve", str(run), "--local", "--step", "3", timeout=180))
    assert line.startswith(f"jobgen serve: cannot export a checkpoint of {run}: ") and _refusal(run, 3) in line, line
    assert not marker.exists() and not (run / "serve-job.json").exists()


def test_resume_sets_the_planted_checkpoints_aside_and_loads_the_previous(planted):
    run, marker = planted
    (run / "done").unlink()
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["train"]["max_steps"] = 4
    (run / "spec.json").write_text(json.dumps(spec))
    proc = torchrun(run, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert not marker.exists()
    assert summary(run)["start_step"] == 1 and summary(run)["end_step"] == 4
    aside = {p.name.rsplit("-", 1)[0]: p for p in (run / "checkpoints").glob("broken-*")}
    assert sorted(aside) == [f"broken-{_name(2)}", f"broken-{_name(3)}"], aside
    errors = json.loads((aside[f"broken-{_name(3)}"] / "broken.json").read_text())["errors"]
    assert all(error.endswith(f": {_refusal(run, 3)}") for error in errors) and len(errors) == 2, errors
    errors = json.loads((aside[f"broken-{_name(2)}"] / "broken.json").read_text())["errors"]
    assert errors and all("it asks for posix.system" in error for error in errors), errors
    assert f"/checkpoints/{_name(2)}/__" in errors[0] and ".distcp (item optim." in errors[0], errors
    assert os.path.islink(run / "checkpoints" / _name(9))  # never taken as this run's: not resumed, not pruned
