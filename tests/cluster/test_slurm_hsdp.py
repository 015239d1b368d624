"""HSDP on the dev cluster (``train.parallelism = "hsdp"``): 2 nodes x 2 processes, each node's
two processes shard the model and the two nodes replicate it (gloo over the nodes' own
network namespaces, as NCCL would cross a cluster's network).

One run is stopped by Slurm's lead-time signal (sent by hand) after step 4 and its next array
task resumes from the checkpoint and finishes; every step's loss equals an uninterrupted HSDP
run's, the mesh is the one the layout implies (2 replicas of 2 shards), and ``jobgen export``
writes a model that ``from_pretrained`` loads, one copy of every tensor of the checkpoint
however many replicas wrote it. tests/distributed/test_hsdp.py proves the same on one machine
against FSDP's losses and gradient norms.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import (
    checkpoint_tensors,
    jobgen,
    losses,
    read_jsonl,
    stopped_at_lead_time_then_finished,
    submit,
    wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

MAX_STEPS = 12
STOP_AFTER = 4
LAYOUT = {"nodes": 2, "procs_per_node": 2, "parallelism": "hsdp", "micro_batch_size": 2, "max_steps": MAX_STEPS}


def rank_logs(run: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (run / "logs" / "ranks").rglob("*.log"))


def test_hsdp_on_two_nodes_trains_resumes_exactly_and_exports(cluster, cluster_run, tmp_path):
    reference = cluster_run("hsdp-ref", **LAYOUT)
    submit(reference.spec)
    run = cluster_run("hsdp", array=2, **LAYOUT)
    job = submit(run.spec)

    first = stopped_at_lead_time_then_finished(run.path, job, STOP_AFTER, MAX_STEPS)
    wait_for(lambda: (reference.path / "done").exists(), 300, "the uninterrupted run to finish")

    starts = [r["start_step"] for r in read_jsonl(run.path / "tasks.jsonl") if r["event"] == "first_step"]
    assert starts == [0, first["end_step"]], starts
    got, expected = losses(run.path), losses(reference.path)
    assert sorted(got) == sorted(expected) == list(range(1, MAX_STEPS + 1)), (sorted(got), sorted(expected))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-5), (step, got[step], expected[step])
    assert "hsdp: 2 replica(s) of the model, each sharded over 2 rank(s)" in rank_logs(run.path)

    target = tmp_path / "exported"
    out = jobgen("export", str(run.path), "--to", str(target))
    assert out.returncode == 0 and f"step-{MAX_STEPS:08d}" in out.stdout, out.stdout + out.stderr
    import torch
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(target).state_dict()
    checkpoint = checkpoint_tensors(run.path / "checkpoints" / f"step-{MAX_STEPS:08d}")
    assert checkpoint and set(checkpoint) <= set(exported)
    for key, tensor in checkpoint.items():
        assert torch.equal(exported[key], tensor.to(exported[key].dtype)), key  # in the model's dtype
