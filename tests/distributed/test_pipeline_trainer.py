"""``train.parallelism = "pipeline"`` through the whole trainer (torchrun, gloo on CPU): the
spec's [train.pipeline], the stages built per rank, the sampler over replicas, the checkpoint
and the loop's stop decisions.

- Two pipeline ranks train exactly as one process does with the same micro_batch_size (the
  loss normalised over the whole batch's target tokens): losses and gradient norms equal
  within float tolerance. The model has 4 blocks, so a 2-rank pipeline with 2 stages per
  rank (interleaved) splits it into 4 stages of one block.
- Two pipelines of two stages (4 ranks, FSDP2 over the replicas) train as DDP on 2 ranks.
- A stop by the kill switch saves at a step boundary; the resume continues exactly.
- ``jobgen export`` of a pipelined checkpoint is one Hugging Face model equal to the
  checkpoint's tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import (
    DATA,
    TRAINER_SETTINGS,
    checkpoint_tensors,
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

STEPS = 8


def make_run(directory: Path, model: Path, procs: int, parallelism: str, **train: object) -> Path:
    from jobgen.loader import load_run
    from jobgen.render import render
    from jobgen.rundir import materialize

    spec_file = run_spec(
        directory,
        parallelism,
        site={"profile": "local", "slurm": {"cpus_per_node": 4}},
        filename=f"{parallelism}.toml",
        job={"time": "1h", "runs_root": "runs", "procs_per_node": procs},
        model={"path": model, "dtype": "float32"},
        data={"path": DATA, "max_length": 128},
        train={**TRAINER_SETTINGS, "max_steps": STEPS, "parallelism": parallelism, **train},
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run.path


def trained(run: Path, procs: int) -> str:
    proc = torchrun(run, nproc=procs, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


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
def one_process(tmp_path_factory, deep_model) -> Path:
    run = make_run(tmp_path_factory.mktemp("ddp1"), deep_model, 1, "ddp")
    trained(run, 1)
    return run


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, deep_model) -> tuple[Path, str]:
    pipeline = {"schedule": "interleaved-1f1b", "microbatches": 2}
    run = make_run(tmp_path_factory.mktemp("pp2"), deep_model, 2, "pipeline", pipeline=pipeline)
    return run, trained(run, 2)


def test_two_stage_ranks_train_as_one_process(pipelined, one_process):
    run, out = pipelined
    assert "pipeline: 4 stage(s) over 2 rank(s) x 1 replica(s), schedule interleaved-1f1b" in out, out[-3000:]
    info = summary(run)
    assert info["exit_code"] == 0 and info["end_step"] == STEPS and info["parallelism"] == "pipeline"
    assert_same_training(run, one_process)


def test_two_pipelines_with_fsdp_train_as_ddp(tmp_path, deep_model):
    reference = make_run(tmp_path / "ddp", deep_model, 2, "ddp")
    trained(reference, 2)
    run = make_run(tmp_path / "pp", deep_model, 4, "pipeline", pipeline={"size": 2, "schedule": "1f1b"})
    out = trained(run, 4)
    assert "pipeline: 2 stage(s) over 2 rank(s) x 2 replica(s), schedule 1f1b" in out, out[-3000:]
    assert_same_training(run, reference)


def test_kill_switch_stops_at_a_step_boundary_and_resumes_exactly(tmp_path, deep_model, pipelined):
    pipeline = {"schedule": "interleaved-1f1b", "microbatches": 2}
    run = make_run(tmp_path, deep_model, 2, "pipeline", pipeline=pipeline)
    stopped, out = stopped_by_kill_switch(run, 2, nproc=2)
    k = stopped["end_step"]
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and 2 <= k < STEPS, out[-3000:]
    assert checkpoints(run) == [f"step-{k:08d}"]
    trained(run, 2)
    assert summary(run)["start_step"] == k
    resumed, expected = losses(run), losses(pipelined[0])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], abs=1e-6), (step, resumed[step], expected[step])


def test_export_is_one_hugging_face_model(tmp_path, pipelined, deep_model):
    import torch
    from transformers import AutoModelForCausalLM

    from jobgen.rundir import RunDir
    from trainer.export import export

    run = pipelined[0]
    source = export(RunDir(run).load_spec(), run, tmp_path / "hf", report=lambda line: None)
    assert source.name == f"step-{STEPS:08d}"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    exported = model.state_dict()
    checkpoint = checkpoint_tensors(source)
    assert set(checkpoint) == set(AutoModelForCausalLM.from_pretrained(deep_model).state_dict())
    for key, tensor in checkpoint.items():
        assert torch.equal(exported[key], tensor), key
