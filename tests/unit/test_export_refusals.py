"""What ``jobgen export`` refuses to read (issue 30): a checkpoint that is not this run's, and
code from a model directory.

- ``--checkpoint`` is the name of a checkpoint directly in the run's checkpoints/: a path
  (``../../other/checkpoints/step-N``) or a link that leads out of it is another run's
  checkpoint, which the export would have reported as this run's. A link is never taken
  as the newest complete checkpoint either (tests/distributed/test_planted_checkpoints.py
  exports around one).
- A model directory whose config asks for its own code (``auto_map``) is refused, never
  asked about: transformers prompts "Do you wish to run the custom code? [y/N]" when
  ``trust_remote_code`` is left unset, and one "y" ran the directory's code as the user.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import VENV_BIN, jobgen
from jobgen.runs.rundir import RunDir, complete_checkpoints_in
from run_dirs import training_run_at_step_25


@pytest.fixture()
def two_runs(tmp_path: Path) -> tuple[RunDir, Path]:
    """This run (with step 5) and another run's checkpoint step-00000010."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "other").mkdir()
    mine = training_run_at_step_25(tmp_path / "mine")
    (mine.checkpoints / "step-00000005").mkdir(parents=True)
    other = training_run_at_step_25(tmp_path / "other")
    theirs = other.checkpoints / "step-00000010"
    theirs.mkdir(parents=True)
    return mine, theirs


@pytest.mark.torch
def test_a_checkpoint_is_named_not_given_as_a_path(two_runs):
    from trainer.checkpoints.export import ExportError, checkpoint_dir

    mine, theirs = two_runs
    assert checkpoint_dir(mine.checkpoints, "step-00000005") == mine.checkpoints / "step-00000005"
    for name in (os.path.relpath(theirs, mine.checkpoints), str(theirs), "..", ".", "", "a/../step-00000005"):
        with pytest.raises(ExportError, match="not a path"):
            checkpoint_dir(mine.checkpoints, name)
    with pytest.raises(ExportError, match="no checkpoint step-00000007 in"):
        checkpoint_dir(mine.checkpoints, "step-00000007")


@pytest.mark.torch
def test_a_link_out_of_the_runs_checkpoints_is_not_its_checkpoint(two_runs):
    from trainer.checkpoints.export import ExportError, checkpoint_dir

    mine, theirs = two_runs
    (mine.checkpoints / "step-00000011").symlink_to(theirs)
    with pytest.raises(ExportError, match=f"leads to {theirs}, outside {mine.checkpoints}: not this run's"):
        checkpoint_dir(mine.checkpoints, "step-00000011")
    assert [step for step, _ in complete_checkpoints_in(mine.checkpoints)] == [5]


@pytest.mark.torch
@pytest.mark.parametrize("how", ["path", "link"])
def test_export_refuses_another_runs_checkpoint_in_one_line(two_runs, tmp_path, how):
    mine, theirs = two_runs
    if how == "link":
        (mine.checkpoints / "step-00000011").symlink_to(theirs)
        name = "step-00000011"
    else:
        name = os.path.relpath(theirs, mine.checkpoints)
    proc = jobgen("export", str(mine.path), "--to", str(tmp_path / "hf"), "--checkpoint", name)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and len(out.strip().splitlines()) == 1, out
    assert out.startswith("jobgen export: ") and ("not a path" if how == "path" else "not this run's") in out, out
    assert not (tmp_path / "hf").exists()


@pytest.mark.torch
def test_export_never_asks_to_run_a_model_directorys_code(tmp_path):
    """The run's model directory is a teammate's, with a config that needs its own code; the
    user would answer "y" to a prompt. Nothing of the directory runs."""
    pytest.importorskip("transformers")
    run = training_run_at_step_25(tmp_path)
    (run.checkpoints / "step-00000005").mkdir(parents=True)
    model = tmp_path / "model"  # the spec's model.path
    marker = tmp_path / "pwned"
    (model / "config.json").write_text(
        json.dumps({"model_type": "planted", "auto_map": {"AutoConfig": "configuration_planted.PlantedConfig"}})
    )
    (model / "configuration_planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class PlantedConfig(PretrainedConfig):\n    model_type = 'planted'\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(VENV_BIN / "jobgen"), "export", str(run.path), "--to", str(tmp_path / "hf")],
        input="y\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert not marker.exists(), out
    assert proc.returncode == 2 and "Do you wish to run the custom code" not in out, out
    assert out.startswith(f"jobgen export: model.path {model}: "), out


def test_the_export_dtype_is_the_base_models_unless_asked_otherwise():
    """model.export_dtype: 'base' is what the base model's config.json names (a bfloat16 model
    trained in float32 on CPU exports bfloat16, as published), or the checkpoint's own where it
    names none; 'as-trained' is always the checkpoint's own (None here)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from trainer.checkpoints.export_weights import export_dtype

    assert export_dtype("base", SimpleNamespace(dtype=torch.bfloat16)) is torch.bfloat16
    assert export_dtype("base", SimpleNamespace(dtype="float16")) is torch.float16
    assert export_dtype("base", SimpleNamespace(dtype=None)) is None
    assert export_dtype("base", SimpleNamespace(dtype="auto")) is None
    assert export_dtype("as-trained", SimpleNamespace(dtype=torch.bfloat16)) is None
    assert export_dtype("float32", SimpleNamespace(dtype=torch.bfloat16)) is torch.float32
