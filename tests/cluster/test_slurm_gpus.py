"""A GPU site on the dev cluster (``cluster up --gpus 3,1,2``: GRES gpu with a fake device file
per GPU, site ``local-gpu``): Slurm places the job where the GPUs are, gives each node's task
its CUDA_VISIBLE_DEVICES, and each rank takes its own GPU of its node's list (recorded in the
rank map and the rank's first log line; the ranks compute on the CPU). The unequal machines
(3 + 1 GPUs) train in tests/cluster/test_slurm_unequal_nodes.py; the refusals of what cannot
be placed are in tests/cluster/test_slurm_submit.py."""

from __future__ import annotations

import json

import pytest

from helpers import jobgen, node, submit, wait_for
from helpers import status as run_status
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def test_a_gpu_sites_run_gets_its_gpus_and_each_rank_its_own(cluster, cluster_run):
    # 2 GPUs per node: only the nodes with 3 and 2 have them (node2 has 1).
    run = cluster_run("gpus", nodes=2, procs_per_node=2, site="local-gpu", max_steps=3)
    submit(run.spec)
    wait_for(lambda: (run.path / "done").exists(), 240, "the GPU site's run to finish")
    (task,) = run_status(run.path)["tasks"]
    assert slurm.hostnames(task["nodes"]) == [node(1), node(3)], task
    # The array's first task has the array's id: scontrol shows every task of it.
    (record,) = [r for r in slurm.show_job(int(task["job_id"])) if r.get("JobId") == str(task["job_id"])]
    assert "gres/gpu=4" in slurm.allocated_tres(record), record

    rank_map = json.loads((run.path / "logs" / "ranks" / str(task["job_id"]) / "ranks.0.json").read_text())
    places = sorted((v["node"], v["local_rank"], v["gpu"]) for v in rank_map.values())
    assert places == [(node(1), 0, "0"), (node(1), 1, "1"), (node(3), 0, "0"), (node(3), 1, "1")], rank_map
    lines = jobgen("logs", str(run.path), "--grep", "GPU 1 of CUDA_VISIBLE_DEVICES", check=True).stdout.splitlines()
    assert len(lines) == 2 and all("GPU 1 of CUDA_VISIBLE_DEVICES=0,1, not used" in x for x in lines), lines
