"""``[eval]`` under ``train.parallelism = "pipeline"`` (issue 50), once refused by validate: the
held-out loss, the best checkpoint, early stopping and samples, through the stages one after
the other (trainer/parallel/pipeline_forward.py), under 1F1B (one stage a rank) and
interleaved 1F1B (two stages a rank), on 2 gloo ranks, each against the same run under FSDP
in one process: the same eval losses at the same steps, the same best checkpoint, the same
early stop, the same samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import eval_losses, local_run, losses, read_jsonl, summary, torchrun_many

pytestmark = pytest.mark.torch

# Every evaluation after the first falls short of min_delta: patience 2 stops the run after
# the third (step 6 of 12), the best being the first (step 2).
EVAL = {
    "split": 0.05,
    "every_steps": 2,
    "patience": 2,
    "min_delta": 10.0,
    "prompts": ["Name three colors.", "What is 2+2?"],
    "max_new_tokens": 6,
}
TRAIN = {
    "max_steps": 12,
    "micro_batch_size": 2,
    "lr": 1e-6,  # near the random start, the samples are tokens, not the end of turn at once
    "save_every_steps": 0,
    "keep_checkpoints": 1,
}
SCHEDULES = {
    "1f1b": {"schedule": "1f1b", "microbatches": 2},
    "interleaved-1f1b": {"schedule": "interleaved-1f1b", "microbatches": 2},
}


def make_run(directory: Path, model: Path, name: str, procs: int, **train: object) -> Path:
    return local_run(directory, model, procs, name, data={"max_length": 128}, eval=EVAL, **{**TRAIN, **train})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, deep_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline-eval")
    found = {
        name: make_run(root / name, deep_model, name, 2, parallelism="pipeline", pipeline=pipeline)
        for name, pipeline in SCHEDULES.items()
    }
    found["fsdp"] = make_run(root / "fsdp", deep_model, "fsdp", 1, parallelism="fsdp")
    for nproc, names in ((2, list(SCHEDULES)), (1, ["fsdp"])):
        proc = torchrun_many([found[name] for name in names], nproc=nproc)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return found


def _samples(run: Path) -> list[tuple[int, str, str]]:
    return [(r["step"], r["prompt"], r["completion"]) for r in read_jsonl(run / "samples.jsonl")]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_pipeline_evaluates_keeps_the_best_stops_early_and_samples_as_fsdp_does(runs, schedule: str):
    pipelined, reference = runs[schedule], runs["fsdp"]
    expected = eval_losses(reference)
    assert sorted(expected) == [2, 4, 6], expected  # patience 2 after the best at step 2
    got = eval_losses(pipelined)
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), (step, got, expected)
    for step, loss in losses(reference).items():
        assert losses(pipelined)[step] == pytest.approx(loss, rel=1e-4), step
    # The same early stop, the same best checkpoint, kept beside the final one.
    ended, reference_end = summary(pipelined), summary(reference)
    assert ended["end_step"] == reference_end["end_step"] == 6, ended
    assert ended["exit_reason"] == reference_end["exit_reason"], (ended, reference_end)
    assert ended["exit_reason"].startswith("early stop: no eval improvement since step 2"), ended
    assert (pipelined / "checkpoints" / "best.json").read_text().count('"step": 2') == 1
    assert sorted(p.name for p in (pipelined / "checkpoints").iterdir() if p.is_dir()) == sorted(
        p.name for p in (reference / "checkpoints").iterdir() if p.is_dir()
    )
    # Greedy answers through the stages: token for token what the unpipelined model answered.
    samples = _samples(pipelined)
    assert samples == _samples(reference) and len(samples) == 3 * len(EVAL["prompts"])
    assert any(completion for _step, _prompt, completion in samples)
