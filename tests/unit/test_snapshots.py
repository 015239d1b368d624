"""Memory snapshots (issue 35, train.snapshot_every_steps): which runs take them, where the
batch script puts them and frees them, and how a snapshot is staged and put back. A crash that
resumes from one: tests/distributed/test_snapshots.py and the dev cluster's relaunch test."""

from __future__ import annotations

import pytest
import torch

from helpers import DATA, check_shell, run_spec
from jobgen.launch.render import render
from jobgen.spec.loader import SpecError, load_run
from trainer.checkpoints.snapshot_checks import SnapshotMismatch
from trainer.checkpoints.snapshot_peers import mirror_targets
from trainer.checkpoints.snapshots import restored, staged

GPU_SITE = {"profile": "local", "slurm": {"gpus_per_node": 4}}  # relaunches twice by default


def spec_with(tmp_path, model, site=GPU_SITE, job=None, **train):
    job = {"nodes": 2, "time": "1h", "runs_root": str(tmp_path / "runs"), **(job or {})}
    return run_spec(
        tmp_path, "r", site=site, job=job, model={"path": str(model)}, data={"path": str(DATA)}, train=train
    )


def test_snapshots_need_a_task_that_relaunches(tmp_path, tiny_model):
    with pytest.raises(SpecError, match=r"train\.snapshot_every_steps: snapshots every 4 steps are read only by"):
        load_run(spec_with(tmp_path, tiny_model, site="local", snapshot_every_steps=4))
    with pytest.raises(SpecError, match=r"train\.snapshot_every_steps"):
        load_run(spec_with(tmp_path, tiny_model, job={"in_job_restarts": 0}, snapshot_every_steps=4))


def test_the_script_gives_each_attempt_its_own_directory_and_frees_it_on_every_node(tmp_path, tiny_model):
    spec = load_run(spec_with(tmp_path, tiny_model, snapshot_every_steps=4))
    script = render(spec)
    (line,) = [x for x in script.splitlines() if x.startswith("JOBGEN_SNAPSHOT_DIR=")]
    assert line.startswith('JOBGEN_SNAPSHOT_DIR=/dev/shm/jobgen-"$(id -u)/'), line
    assert line.endswith('/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"'), line
    assert "\nexport JOBGEN_SNAPSHOT_DIR\n" in script
    # The supervisor frees them on every node as the task ends, whatever ended it (jobgen.job.supervisor.finish).
    assert script.rstrip().endswith('exec python -m jobgen.job --settings "$JOBGEN_SUPERVISOR"')
    check_shell(script, tmp_path)
    # Another run gets another directory; a run without snapshots exports none.
    other = load_run(spec_with(tmp_path / "b", tiny_model, snapshot_every_steps=4))
    assert line not in render(other)
    assert "JOBGEN_SNAPSHOT_DIR" not in render(load_run(spec_with(tmp_path / "c", tiny_model)))


def test_a_staged_copy_does_not_move_with_training_and_goes_back_in_place():
    weight, step = torch.ones(3), torch.tensor(5.0)
    state = {"model": {"w": weight}, "optim": {"state": {"w": {"step": step}}, "param_groups": [{"lr": 0.1}]}}
    copy = staged(state)
    weight.add_(1)  # training goes on
    assert torch.equal(copy["model"]["w"], torch.ones(3)) and copy["optim"]["param_groups"] == [{"lr": 0.1}]
    back = restored(state, copy)
    assert back["model"]["w"] is weight and torch.equal(weight, torch.ones(3))  # in place


@pytest.mark.parametrize(
    ("saved", "where"),
    [
        ({"model": {"w": torch.ones(4)}}, r"model\.w: the snapshot holds \(4,\), this launch \(3,\)"),
        ({"model": {"v": torch.ones(3)}}, r"model: the snapshot's keys are not this launch's"),
        ({"model": {"w": [1.0]}}, r"model\.w: the snapshot holds list, this launch \(3,\)"),
    ],
)
def test_a_snapshot_of_another_shape_is_refused_naming_where(saved, where):
    with pytest.raises(SnapshotMismatch, match=where):
        restored({"model": {"w": torch.ones(3)}}, saved)


@pytest.mark.parametrize(
    ("nodes", "targets"),
    [
        (["a", "b"], [1, 0]),  # two nodes of one rank: each keeps the other's
        (["a", "a", "b", "b", "c", "c"], [2, 3, 4, 5, 0, 1]),  # the same place on the next node
        (["a", "a", "a", "b"], [3, 3, 3, 0]),  # unequal nodes: the next node's ranks, round
        (["b", "a"], [1, 0]),  # nodes in the order of their first rank
    ],
)
def test_each_rank_is_mirrored_on_the_next_node(nodes, targets):
    assert mirror_targets(nodes) == targets
    assert all(nodes[t] != nodes[r] for r, t in enumerate(targets))  # never on its own node
