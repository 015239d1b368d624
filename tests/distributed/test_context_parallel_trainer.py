"""``train.context_parallel`` through the whole trainer (torchrun, gloo on CPU): each row split
across the ranks of a context-parallel group, which read the same rows.

- CP = 2 on 2 processes trains exactly as one process does on the same rows (packed rows of
  several documents, so the document-causal mask matters): every step's loss and gradient norm
  equal within float tolerance, and the target tokens are counted once.
- CP = 2 x 2 replicas under FSDP2 (4 processes) trains as DDP on 2 processes (marker ``full``).
- A stop by the kill switch and the resume give exactly the uninterrupted run's losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import (
    assert_same_training,
    checkpoints,
    local_run,
    losses,
    stopped_by_kill_switch,
    summary,
    trained_locally,
)
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch

STEPS = 6


def make_run(directory: Path, model: Path, procs: int, parallelism: str, **train: object) -> Path:
    keys = {"max_steps": STEPS, "parallelism": parallelism, **train}
    return local_run(directory, model, procs, "cp", data={"max_length": 128, "packing": True}, **keys)


@pytest.fixture(scope="module")
def context_parallel(tmp_path_factory, tiny_model) -> Path:
    run = make_run(tmp_path_factory.mktemp("cp2"), tiny_model, 2, "ddp", context_parallel=2)
    trained_locally(run, 2)
    return run


def test_two_ranks_splitting_each_row_train_as_one_process(tmp_path, tiny_model, context_parallel):
    reference = make_run(tmp_path, tiny_model, 1, "ddp")
    trained_locally(reference, 1)
    info = summary(context_parallel)
    assert info["exit_code"] == 0 and info["end_step"] == STEPS
    assert_same_training(context_parallel, reference, STEPS)


@pytest.mark.full  # tests/distributed/test_context_parallel.py proves CP=2 x 2 under FSDP2 in CI
def test_two_groups_under_fsdp_train_as_ddp_on_two(tmp_path, tiny_model):
    reference = make_run(tmp_path / "ddp", tiny_model, 2, "ddp")
    trained_locally(reference, 2)
    run = make_run(tmp_path / "cp", tiny_model, 4, "fsdp", context_parallel=2)
    trained_locally(run, 4)
    assert_same_training(run, reference, STEPS)


def test_kill_switch_and_resume_are_exact(tmp_path, tiny_model, context_parallel):
    run = make_run(tmp_path, tiny_model, 2, "ddp", context_parallel=2)
    stopped, out = stopped_by_kill_switch(run, 2, nproc=2)
    k = stopped["end_step"]
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and 2 <= k < STEPS, out[-3000:]
    assert checkpoints(run) == [f"step-{k:08d}"]
    trained_locally(run, 2)
    resumed, expected = losses(run), losses(context_parallel)
    assert summary(run)["start_step"] == k and sorted(resumed) == list(range(1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], abs=1e-6), (step, resumed[step], expected[step])
