"""Unequal machines on the dev cluster (``job.procs_per_node = [3, 1]``) as a GPU site sees
them: nodes with 3 and 1 fake GPUs (``cluster up --gpus 3,1,2``, site ``local-gpu``), one
allocation of 2 nodes asking for 4 GPUs in all (``--gpus=4``), which Slurm splits 3 + 1; each
node's torchrun started with its own count, 4 ranks numbered node by node (ranks 0-2 on the
first node of the allocation, 3 on the second, as the rank logs and the rank map say), each
rank on its own GPU of its node's CUDA_VISIBLE_DEVICES (recorded: the ranks compute on the
CPU), DDP with each rank its own data shard.

The run is stopped by Slurm's lead-time signal (sent by hand, as a time limit sends it) after
step 4; its next array task resumes from the checkpoint and finishes, and both tasks end
COMPLETED. Every step's loss equals that of an uninterrupted run of 4 ranks on one node beside
it: the same world, the same samples, whatever the nodes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import (
    jobgen,
    losses,
    node,
    node_range,
    read_jsonl,
    stopped_at_lead_time_then_finished,
    submit,
    wait_for,
)
from helpers import status as run_status
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

MAX_STEPS = 12
STOP_AFTER = 4
# The dev cluster's nodes have 4 CPUs: enough for 3 processes (the local profiles ask for 2),
# and 3, 1 and 2 fake GPUs. The reference computes alike without asking for GPUs.
SITE = {"profile": "local-gpu", "slurm": {"cpus_per_node": 4, "gpus_per_node": 3}}
REFERENCE_SITE = {"profile": "local", "slurm": {"cpus_per_node": 4}}
TRAIN = {"parallelism": "ddp", "micro_batch_size": 2, "max_steps": MAX_STEPS}
# "trainer[3] INFO rank 3 of 4 on node2 (local rank 0, GPU 0 of CUDA_VISIBLE_DEVICES=0, not used:
# the site computes on the CPU), pid 123": each rank's first line.
RANK_LINE = re.compile(r"trainer\[(\d+)\] INFO rank \d+ of (\d+) on (\S+) \(local rank (\d+), GPU (\d+) of ")


def rank_places(run: Path, job_id: int) -> dict[int, tuple[str, int, str]]:
    """Global rank -> (node, local rank, GPU), from the rank logs of one task."""
    places = {}
    for log in (run / "logs" / "ranks" / str(job_id)).rglob("*.log"):
        for rank, world, host, local, gpu in RANK_LINE.findall(log.read_text(errors="replace")):
            assert world == "4", log
            places[int(rank)] = (host, int(local), gpu)
    return places


def test_three_and_one_processes_train_resume_exactly_and_complete(cluster, cluster_run):
    # The run on the first node (3 processes) and the second (1); the reference, 4 processes, on the third.
    run = cluster_run(
        "uneq", nodes=2, procs_per_node=[3, 1], array=2, site=SITE, job={"nodelist": [node_range(1, 2)]}, **TRAIN
    )
    job = submit(run.spec)
    reference = cluster_run("uneq-ref", procs_per_node=4, site=REFERENCE_SITE, job={"nodelist": [node(3)]}, **TRAIN)
    submit(reference.spec)

    first = stopped_at_lead_time_then_finished(run.path, job, STOP_AFTER, MAX_STEPS)
    wait_for(lambda: (reference.path / "done").exists(), 300, "the uninterrupted run to finish")

    # Ranks 0-2 on the first node of the allocation, 3 on the second, in both tasks, each on a GPU of its own.
    tasks = run_status(run.path)["tasks"]
    assert [t["state"] for t in tasks] == ["COMPLETED", "COMPLETED"], tasks
    expected = {0: (node(1), 0, "0"), 1: (node(1), 1, "1"), 2: (node(1), 2, "2"), 3: (node(2), 0, "0")}
    for entry in tasks:
        assert rank_places(run.path, entry["job_id"]) == expected, entry
        rank_map = json.loads((run.path / "logs" / "ranks" / str(entry["job_id"]) / "ranks.0.json").read_text())
        assert {int(r): (v["node"], v["local_rank"], v["gpu"]) for r, v in rank_map.items()} == expected
        # Slurm gave the job the 4 GPUs, 3 on the first node and 1 on the second.
        # The array's first task has the array's id: scontrol shows every task of it.
        (record,) = [r for r in slurm.show_job(int(entry["job_id"])) if r.get("JobId") == str(entry["job_id"])]
        assert "gres/gpu=4" in slurm.allocated_tres(record), record

    # Resumed exactly: the second task starts where the first saved, nothing redone, and every
    # step's loss is the uninterrupted run's.
    starts = [r["start_step"] for r in read_jsonl(run.path / "tasks.jsonl") if r["event"] == "first_step"]
    assert starts == [0, first["end_step"]], starts
    assert tasks[1]["recomputed_steps"] == 0, tasks
    got, want = losses(run.path), losses(reference.path)
    assert sorted(got) == sorted(want) == list(range(1, MAX_STEPS + 1)), (sorted(got), sorted(want))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, got[step], want[step])

    text = jobgen("status", str(run.path), check=True).stdout
    assert "nodes    2 nodes with 3 + 1 processes = world size 4" in text, text


def test_the_profile_site_init_wrote_places_3_and_1_without_a_nodelist(cluster, cluster_run, tmp_path, monkeypatch):
    """Issue 46: `jobgen site init` describes the nodes (slurm.node_shapes: 3, 1 and 2 GPUs), and a
    run with procs_per_node = [3, 1] and no job.nodelist validates against that profile as it is
    and is placed on the node with 3 GPUs and the one with 1, a GPU of its own per rank."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    jobgen("site", "init", "devgpus", "--ifname", "eth0", "--no-gpu-compute", check=True)
    run = cluster_run("uneq-shapes", nodes=2, procs_per_node=[3, 1], site="devgpus", max_steps=3, parallelism="ddp")
    checked = jobgen("validate", str(run.spec), check=True)
    assert "site 'devgpus'" in checked.stdout
    job = submit(run.spec)
    wait_for(lambda: (run.path / "done").exists(), 240, "the run placed from the profile's node shapes")
    (task,) = run_status(run.path)["tasks"]
    assert slurm.hostnames(task["nodes"]) == [node(1), node(2)], task
    expected = {0: (node(1), 0, "0"), 1: (node(1), 1, "1"), 2: (node(1), 2, "2"), 3: (node(2), 0, "0")}
    assert rank_places(run.path, job) == expected
