"""The global batch across world sizes, under torchrun on gloo: a run stopped on 2 processes
resumes on 1.

- With ``train.global_batch_size`` the resumed task derives ``grad_accum`` (2 -> 4) and its
  losses are those of the uninterrupted 2-process run: the same samples in every step.
- Without it, the resume is refused: exit BATCH_CHANGED naming the keys and the fix, the
  run's ``failed`` marker set (every later task would repeat it), and ``jobgen submit`` of the
  run refuses the same change before anything is queued.
"""

from __future__ import annotations

import json

import pytest

from helpers import checkpoints, jobgen, losses, make_run, read_jsonl, stopped_by_kill_switch, summary, torchrun
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch

STEPS = 8


def test_a_kept_global_batch_resumes_on_another_world_size_with_the_same_losses(tmp_path, tiny_model):
    keys = {"max_steps": STEPS, "micro_batch_size": 2, "global_batch_size": 8, "parallelism": "fsdp"}
    reference = make_run(tmp_path / "a", tiny_model, **keys)
    assert torchrun(reference, nproc=2).returncode == 0
    expected = losses(reference)

    run = make_run(tmp_path / "b", tiny_model, **keys)
    stopped, out = stopped_by_kill_switch(run, 2)
    k = stopped["end_step"]
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and k < STEPS, out
    assert (stopped["world_size"], stopped["grad_accum"], stopped["global_batch"]) == (2, 2, 8)

    proc = torchrun(run, nproc=1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = summary(run)
    assert (resumed["world_size"], resumed["grad_accum"], resumed["global_batch"]) == (1, 4, 8)
    assert "global batch 8 = train.micro_batch_size 2 x train.grad_accum 4 x world size 1" in proc.stdout + proc.stderr
    after = losses(run)
    for step in range(1, STEPS + 1):
        assert after[step] == pytest.approx(expected[step], rel=1e-4), (step, after[step], expected[step])
    starts = [r for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "first_step"]
    assert [(r["world_size"], r["grad_accum"], r["global_batch"]) for r in starts] == [(2, 2, 8), (1, 4, 8)]


def test_a_changed_global_batch_is_refused_with_the_keys_that_fix_it(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, max_steps=STEPS, micro_batch_size=2, grad_accum=1, parallelism="ddp")
    stopped, out = stopped_by_kill_switch(run, 2)
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH, out
    saved = checkpoints(run)

    proc = torchrun(run, nproc=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exit {int(ExitCode.BATCH_CHANGED)}: " in out, out
    for words in ("global batch of 4", "this task's is 2", "train.global_batch_size", "train.allow_batch_change"):
        assert words in out, (words, out)
    failed = json.loads((run / "failed").read_text())
    assert failed["exit_code"] == ExitCode.BATCH_CHANGED and "train.global_batch_size" in failed["fix"]
    assert checkpoints(run) == saved  # nothing trained, nothing written

    # submit finds it before the queue wait: the spec asks for one process now.
    spec = tmp_path / "sft.toml"
    spec.write_text(spec.read_text().replace("[job]\n", "[job]\nprocs_per_node = 1\n", 1))
    refused = jobgen("submit", str(spec), "--dry-run")  # refused before Slurm is asked
    assert refused.returncode != 0 and "train.global_batch_size" in refused.stderr, refused.stdout + refused.stderr
    assert "this task's is 2" in refused.stderr
