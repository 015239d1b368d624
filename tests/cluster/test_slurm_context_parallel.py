"""Context parallelism on the dev cluster (``train.context_parallel = 2``): two nodes, one
process each, so every layer's keys and values are gathered across the nodes' own network
namespaces (gloo over TCP). Packed rows of several documents, so the document mask matters.

A run stopped mid-way by Slurm's lead-time signal resumes in its next array task, and every
step's loss and gradient norm equal those of one process training on the whole rows.
tests/distributed/test_context_parallel_trainer.py proves the same on one machine, and
tests/distributed/test_context_parallel.py the attention itself against the unsharded model.
"""

from __future__ import annotations

import pytest

from helpers import (
    assert_same_training,
    read_jsonl,
    stopped_at_lead_time_then_finished,
    submit,
    wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

MAX_STEPS = 12
STOP_AFTER = 3
PACKED = {"packing": True}


def test_context_parallel_across_two_nodes_equals_one_process_and_resumes_exactly(cluster_run):
    reference = cluster_run("cp-one", nodes=1, procs_per_node=1, max_steps=MAX_STEPS, data=PACKED)
    submit(reference.spec)
    run = cluster_run(
        "cp-two", nodes=2, procs_per_node=1, array=2, max_steps=MAX_STEPS, context_parallel=2, data=PACKED
    )
    job = submit(run.spec)

    first = stopped_at_lead_time_then_finished(run.path, job, STOP_AFTER, MAX_STEPS)
    wait_for(lambda: (reference.path / "done").exists(), 300, "the one-process run to finish")

    starts = [r["start_step"] for r in read_jsonl(run.path / "tasks.jsonl") if r["event"] == "first_step"]
    assert starts == [0, first["end_step"]], starts
    assert_same_training(run.path, reference.path, MAX_STEPS)
