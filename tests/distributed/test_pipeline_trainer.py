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
    assert_same_training,
    checkpoint_tensors,
    checkpoints,
    local_run,
    losses,
    stopped_by_kill_switch,
    summary,
    trained_locally,
)
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch

STEPS = 8


def make_run(directory: Path, model: Path, procs: int, parallelism: str, **train: object) -> Path:
    keys = {"max_steps": STEPS, "parallelism": parallelism, **train}
    return local_run(directory, model, procs, parallelism, data={"max_length": 128}, **keys)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, deep_model) -> Path:
    run = make_run(tmp_path_factory.mktemp("ddp1"), deep_model, 1, "ddp")
    trained_locally(run, 1)
    return run


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, deep_model) -> tuple[Path, str]:
    pipeline = {"schedule": "interleaved-1f1b", "microbatches": 2}
    run = make_run(tmp_path_factory.mktemp("pp2"), deep_model, 2, "pipeline", pipeline=pipeline)
    return run, trained_locally(run, 2)


def test_two_stage_ranks_train_as_one_process(pipelined, one_process):
    run, out = pipelined
    assert "pipeline: 4 stage(s) over 2 rank(s) x 1 replica(s), schedule interleaved-1f1b" in out, out[-3000:]
    info = summary(run)
    assert info["exit_code"] == 0 and info["end_step"] == STEPS and info["parallelism"] == "pipeline"
    assert_same_training(run, one_process, STEPS)


def test_two_pipelines_with_fsdp_train_as_ddp(tmp_path, deep_model):
    reference = make_run(tmp_path / "ddp", deep_model, 2, "ddp")
    trained_locally(reference, 2)
    run = make_run(tmp_path / "pp", deep_model, 4, "pipeline", pipeline={"size": 2, "schedule": "1f1b"})
    out = trained_locally(run, 4)
    assert "pipeline: 2 stage(s) over 2 rank(s) x 2 replica(s), schedule 1f1b" in out, out[-3000:]
    assert_same_training(run, reference, STEPS)


def test_kill_switch_stops_at_a_step_boundary_and_resumes_exactly(tmp_path, deep_model, pipelined):
    pipeline = {"schedule": "interleaved-1f1b", "microbatches": 2}
    run = make_run(tmp_path, deep_model, 2, "pipeline", pipeline=pipeline)
    stopped, out = stopped_by_kill_switch(run, 2, nproc=2)
    k = stopped["end_step"]
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and 2 <= k < STEPS, out[-3000:]
    assert checkpoints(run) == [f"step-{k:08d}"]
    trained_locally(run, 2)
    assert summary(run)["start_step"] == k
    resumed, expected = losses(run), losses(pipelined[0])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], abs=1e-6), (step, resumed[step], expected[step])


def test_export_is_one_hugging_face_model(tmp_path, pipelined, deep_model):
    import torch
    from transformers import AutoModelForCausalLM

    from jobgen.runs.rundir import RunDir
    from trainer.checkpoints.export import export

    run = pipelined[0]
    source = export(RunDir(run).load_spec(), run, tmp_path / "hf", report=lambda line: None)
    assert source.name == f"step-{STEPS:08d}"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    exported = model.state_dict()
    checkpoint = checkpoint_tensors(source)
    assert set(checkpoint) == set(AutoModelForCausalLM.from_pretrained(deep_model).state_dict())
    for key, tensor in checkpoint.items():
        assert torch.equal(exported[key], tensor), key
