"""A GPU site as Slurm sees it, without Slurm (the dev cluster's fake GPUs are in
tests/cluster/test_slurm_gpus.py): the GPU each rank takes from the node's
CUDA_VISIBLE_DEVICES, the request of equal and unequal nodes, the refusals that name the nodes
and their counts, and a site whose ranks compute on the CPU (slurm.gpu_compute = false)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import DATA, run_spec, spec_issues
from jobgen.launch.preflight import _ClusterFacts, _decide
from jobgen.launch.render import render, sbatch_directives
from jobgen.runtime.devices import MissingGpu, node_gpus, rank_gpu
from jobgen.spec.loader import load_run

GPU_SITE = {"profile": "local-gpu", "slurm": {"cpus_per_node": 4, "gpus_per_node": 3}}


def spec(tmp_path: Path, *, job=None, site=None) -> Path:
    job = {"time": "1h", "nodes": 2, "procs_per_node": 2, "runs_root": str(tmp_path / "runs"), **(job or {})}
    return run_spec(
        tmp_path, "gpu", site=site or GPU_SITE, job=job, model={"path": "org/m"}, data={"path": str(DATA)}, train={}
    )


def test_each_rank_takes_its_local_ranks_entry_of_the_nodes_gpus():
    env = {"CUDA_VISIBLE_DEVICES": "4,6,7", "SLURMD_NODENAME": "node1", "LOCAL_WORLD_SIZE": "4"}
    assert node_gpus(env) == ["4", "6", "7"]
    assert [rank_gpu({**env, "LOCAL_RANK": str(r)}) for r in range(3)] == ["4", "6", "7"]
    with pytest.raises(MissingGpu, match=r"local rank 3 has no GPU on node1: Slurm gave it 3 .* for 4 processes"):
        rank_gpu({**env, "LOCAL_RANK": "3"})
    for none in ({}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}):
        assert rank_gpu({**none, "LOCAL_RANK": "1"}) is None


def test_equal_nodes_ask_each_node_and_unequal_ones_the_whole_job(tmp_path):
    # One GPU per process: 2 processes on nodes of 3 GPUs ask for 2 (asking for 3 fitted only the
    # largest nodes of a cluster whose nodes differ, and left one idle on each).
    equal = load_run(spec(tmp_path / "a"))
    assert "--gres=gpu:2" in sbatch_directives(equal) and equal.gpus_per_node == 2
    assert "--gres=gpu:3" in sbatch_directives(load_run(spec(tmp_path / "d", job={"procs_per_node": 3})))
    unequal = load_run(spec(tmp_path / "b", job={"procs_per_node": [3, 1], "nodelist": ["node1", "node2"]}))
    directives = sbatch_directives(unequal)
    assert "--gpus=4" in directives and not any(d.startswith("--gres") for d in directives), directives
    typed = {**GPU_SITE, "slurm": {**GPU_SITE["slurm"], "gres_name": "gpu:h100"}}
    job = {"procs_per_node": [3, 1], "nodelist": ["node1", "node2"]}
    assert "--gpus=h100:4" in sbatch_directives(load_run(spec(tmp_path / "c", job=job, site=typed)))


def test_unequal_nodes_on_a_gpu_site_need_their_nodes_named(tmp_path):
    issues = spec_issues(spec(tmp_path, job={"procs_per_node": [3, 1]}))
    assert "job.nodelist" in issues and "exactly 3 and 1 GPUs" in issues["job.nodelist"], issues
    other = {**GPU_SITE, "slurm": {**GPU_SITE["slurm"], "gres_name": "shard"}}
    issues = spec_issues(spec(tmp_path / "s", job={"procs_per_node": [3, 1], "nodelist": ["n1", "n2"]}, site=other))
    assert "counts gres 'gpu' only" in issues["site.slurm.gres_name"], issues


NODES = {  # the CI dev cluster's GPUs: 3, 1, 2
    f"node{i}": {"NodeName": f"node{i}", "CPUTot": "4", "State": "IDLE", "Gres": f"gpu:{g}(S:0)"}
    for i, g in ((1, 3), (2, 1), (3, 2))
}
PART = {"PartitionName": "debug", "Default": "YES", "MaxTime": "UNLIMITED", "Nodes": "node[1-3]", "State": "UP"}


def findings(tmp_path: Path, **job) -> list[tuple[str, str, str]]:
    loaded = load_run(spec(tmp_path, job=job))
    wanted = frozenset(job.get("nodelist", []))
    facts = _ClusterFacts((22, 5), {"debug": PART}, "debug", PART, None, frozenset(NODES), frozenset(), wanted, NODES)
    return [(f.level, f.key, f.message) for f in _decide(loaded, facts) if "gpu" in f.message.lower() or "GPU" in f.key]


def test_preflight_places_unequal_nodes_only_where_each_has_its_entrys_gpus(tmp_path):
    placed = findings(tmp_path / "a", procs_per_node=[3, 1], nodelist=["node2", "node1"])
    assert placed == [("info", "job.procs_per_node", "processes and GPUs per node, node by node: node1 3, node2 1")]
    (refused,) = findings(tmp_path / "b", procs_per_node=[3, 1], nodelist=["node1", "node3"])
    assert refused[0] == "error" and "(node1 3, node3 2, gres 'gpu', in Slurm's order)" in refused[2], refused


def test_preflight_names_each_nodes_gpus_when_too_few_have_enough(tmp_path):
    site = {**GPU_SITE, "slurm": {**GPU_SITE["slurm"], "gpus_per_node": 4}}
    loaded = load_run(spec(tmp_path, site=site, job={"procs_per_node": 4}))
    facts = _ClusterFacts(
        (22, 5), {"debug": PART}, "debug", PART, None, frozenset(NODES), frozenset(), frozenset(), NODES
    )
    (error,) = [f for f in _decide(loaded, facts) if f.key == "site.slurm.gpus_per_node"]
    assert error.level == "error" and "0 node(s) of partition 'debug' have that (node1 3, node2 1, node3 2)" in (
        error.message
    ), error.message
    # 2 processes a node ask for 2 GPUs, which two of the nodes have (the site's 4 would fit none).
    fits = load_run(spec(tmp_path / "two", site=site, job={"procs_per_node": 2}))
    assert not [f for f in _decide(fits, facts) if f.key == "site.slurm.gpus_per_node"]


def test_a_site_that_computes_on_the_cpu_counts_slurms_gpus_not_the_drivers(tmp_path):
    text = render(load_run(spec(tmp_path)))
    assert "Slurm gave ${given_count:-0} GPU(s)" in text and "nvidia-smi" not in text
    gpu_compute = {**GPU_SITE, "slurm": {**GPU_SITE["slurm"], "gpu_compute": True}}
    assert "nvidia-smi -L" in render(load_run(spec(tmp_path / "real", site=gpu_compute)))


def test_your_programs_ranks_record_their_gpu_beside_their_nodes_logs(tmp_path, capsys):
    from jobgen.runs.rundir import RunDir
    from jobgen.runtime.launch import record_rank_identity

    run = RunDir(tmp_path)
    env = {"SLURMD_NODENAME": "node1", "RANK": "5", "GROUP_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    record_rank_identity(run, "7", 0, {**env, "LOCAL_RANK": "1"})
    assert json.loads(run.rank_identity("7", "node1", 0, "1").read_text()) == {"rank": 5, "group_rank": 1, "gpu": "3"}
    record_rank_identity(run, "7", 0, {**env, "LOCAL_RANK": "2"})  # a rank the node has no GPU for
    assert "gpu" not in json.loads(run.rank_identity("7", "node1", 0, "2").read_text())
    assert "local rank 2 has no GPU on node1" in capsys.readouterr().err
