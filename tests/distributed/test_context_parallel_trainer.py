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
    DATA,
    TRAINER_SETTINGS,
    checkpoints,
    losses,
    read_jsonl,
    run_spec,
    stopped_by_kill_switch,
    summary,
    torchrun,
)
from jobgen.exit_codes import ExitCode

pytestmark = pytest.mark.torch

STEPS = 6


def make_run(directory: Path, model: Path, procs: int, parallelism: str, **train: object) -> Path:
    from jobgen.loader import load_run
    from jobgen.render import render
    from jobgen.rundir import materialize

    spec_file = run_spec(
        directory,
        "cp",
        site={"profile": "local", "slurm": {"cpus_per_node": 4}},
        filename="cp.toml",
        job={"time": "1h", "runs_root": "runs", "procs_per_node": procs},
        model={"path": model, "dtype": "float32"},
        data={"path": DATA, "max_length": 128, "packing": True},
        train={**TRAINER_SETTINGS, "max_steps": STEPS, "parallelism": parallelism, **train},
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run.path


def trained(run: Path, procs: int) -> None:
    proc = torchrun(run, nproc=procs, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def metric(run: Path, name: str) -> dict[int, float]:
    return {r["step"]: r[name] for r in read_jsonl(run / "metrics.jsonl") if r.get("event") != "eval"}


def assert_same_training(run: Path, reference: Path) -> None:
    curve, expected = losses(run), losses(reference)
    assert sorted(curve) == list(range(1, STEPS + 1))
    for step in curve:
        assert curve[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-5), (step, curve, expected)
    norms, expected_norms = metric(run, "grad_norm"), metric(reference, "grad_norm")
    for step in norms:
        assert norms[step] == pytest.approx(expected_norms[step], rel=1e-3), (step, norms, expected_norms)
    assert metric(run, "step_target_tokens") == metric(reference, "step_target_tokens")


@pytest.fixture(scope="module")
def context_parallel(tmp_path_factory, tiny_model) -> Path:
    run = make_run(tmp_path_factory.mktemp("cp2"), tiny_model, 2, "ddp", context_parallel=2)
    trained(run, 2)
    return run


def test_two_ranks_splitting_each_row_train_as_one_process(tmp_path, tiny_model, context_parallel):
    reference = make_run(tmp_path, tiny_model, 1, "ddp")
    trained(reference, 1)
    info = summary(context_parallel)
    assert info["exit_code"] == 0 and info["end_step"] == STEPS
    assert_same_training(context_parallel, reference)


@pytest.mark.full  # tests/distributed/test_context_parallel.py proves CP=2 x 2 under FSDP2 in CI
def test_two_groups_under_fsdp_train_as_ddp_on_two(tmp_path, tiny_model):
    reference = make_run(tmp_path / "ddp", tiny_model, 2, "ddp")
    trained(reference, 2)
    run = make_run(tmp_path / "cp", tiny_model, 4, "fsdp", context_parallel=2)
    trained(run, 4)
    assert_same_training(run, reference)


def test_kill_switch_and_resume_are_exact(tmp_path, tiny_model, context_parallel):
    run = make_run(tmp_path, tiny_model, 2, "ddp", context_parallel=2)
    stopped, out = stopped_by_kill_switch(run, 2, nproc=2)
    k = stopped["end_step"]
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and 2 <= k < STEPS, out[-3000:]
    assert checkpoints(run) == [f"step-{k:08d}"]
    trained(run, 2)
    resumed, expected = losses(run), losses(context_parallel)
    assert summary(run)["start_step"] == k and sorted(resumed) == list(range(1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], abs=1e-6), (step, resumed[step], expected[step])
