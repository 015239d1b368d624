"""What a run may change between tasks, checked before anything is queued: the global batch
(train.global_batch_size, grad_accum derived per world size), job.min_nodes, HSDP's shard
groups and CPU offload, each with the file and the key that fixes it; and what the preflight
says when quarantine leaves fewer nodes than job.nodes."""

from __future__ import annotations

import pytest

from helpers import DATA, run_spec, spec_issues
from jobgen.launch.preflight import Finding, _ClusterFacts, _decide
from jobgen.spec.global_batch import BatchShape, GlobalBatchChanged, GlobalBatchError, check_resume, grad_accum_for
from jobgen.spec.loader import load_run
from jobgen.spec.tables.train import TrainSpec


def spec(tmp_path, *, job=None, train=None, site="local"):
    job = {"time": "1h", "procs_per_node": 2, **(job or {})}
    train = {"micro_batch_size": 1, **(train or {})}
    return run_spec(tmp_path, "ws", site=site, job=job, model={"path": "org/m"}, data={"path": str(DATA)}, train=train)


@pytest.mark.parametrize(
    "job, train, key, words",
    [
        pytest.param({}, {"global_batch_size": 8, "grad_accum": 2}, "train", "are both set", id="gbs-and-accum"),
        pytest.param({"nodes": 3}, {"global_batch_size": 10}, "train.global_batch_size", "on 3 node(s)", id="gbs"),
        pytest.param(
            {"nodes": 3, "min_nodes": 2},
            {"global_batch_size": 16},
            "train.global_batch_size",
            "on 3 node(s)",
            id="gbs-on-a-smaller-world",
        ),
        pytest.param({"nodes": 2, "min_nodes": 3}, {}, "job", "at most job.nodes", id="min-above-nodes"),
        pytest.param({"nodes": 3, "min_nodes": 2}, {}, "", "train.global_batch_size", id="min-nodes-no-gbs"),
        pytest.param({}, {"shard_size": 2}, "train", "only used with train.parallelism = 'hsdp'", id="shard-fsdp"),
        pytest.param(
            {"nodes": 3},
            {"parallelism": "hsdp", "shard_size": 4},
            "train.shard_size",
            "must divide the world size 6",
            id="shard-divides",
        ),
        pytest.param(
            {}, {"parallelism": "fsdp", "cpu_offload": True}, "train.cpu_offload", "has no GPUs", id="offload-cpu-site"
        ),
        pytest.param({}, {"cpu_offload": True}, "train", "parallelism = 'fsdp' or 'hsdp'", id="offload-ddp"),
    ],
)
def test_a_world_the_run_may_get_is_checked_with_the_key_that_fixes_it(tmp_path, job, train, key, words):
    issues = spec_issues(spec(tmp_path, job=job, train=train))
    assert key in issues and words in issues[key], issues


def test_min_nodes_with_a_global_batch_that_divides_every_world(tmp_path):
    loaded = load_run(spec(tmp_path, job={"nodes": 3, "min_nodes": 2}, train={"global_batch_size": 12}))
    assert list(loaded.run.job.node_counts) == [2, 3]
    assert [grad_accum_for(loaded.run.train, n * 2) for n in (2, 3)] == [3, 2]


def test_grad_accum_is_derived_per_world_and_a_change_refused_unless_allowed():
    train = TrainSpec(micro_batch_size=2, global_batch_size=24)
    assert [grad_accum_for(train, w) for w in (1, 2, 3, 4, 6, 12)] == [12, 6, 4, 3, 2, 1]
    with pytest.raises(GlobalBatchError, match=r"train\.micro_batch_size 2 x world size 5 = 10"):
        grad_accum_for(train, 5)
    fixed = TrainSpec(micro_batch_size=2, grad_accum=3)
    saved, now = BatchShape(2, 3, 4), BatchShape(2, 3, 2)
    with pytest.raises(GlobalBatchChanged) as info:
        check_resume(saved, now, fixed)
    assert "global batch of 24" in str(info.value) and "this task's is 12" in str(info.value)
    check_resume(saved, now, TrainSpec(micro_batch_size=2, grad_accum=3, allow_batch_change=True))
    check_resume(None, now, fixed)  # a checkpoint from before shapes were recorded
    check_resume(saved, BatchShape(2, 6, 2), fixed)  # same global batch


def facts(excluded: set[str], min_nodes: int | None) -> tuple[object, _ClusterFacts]:
    nodes = {f"n{i}": {"NodeName": f"n{i}", "CPUTot": "4", "State": "IDLE", "Gres": ""} for i in (1, 2, 3)}
    part = {"PartitionName": "p", "Default": "YES", "MaxTime": "UNLIMITED", "Nodes": "n[1-3]", "State": "UP"}
    found = _ClusterFacts(
        (23, 2), {"p": part}, "p", part, None, frozenset(nodes), frozenset(excluded), frozenset(), nodes
    )
    return min_nodes, found


@pytest.mark.parametrize(
    "excluded, min_nodes, level, words",
    [
        ({"n3"}, None, "error", "3 nodes requested but partition 'p' has 2 after excluding n3"),
        ({"n3"}, 2, "info", "tasks run on 2 until more are back"),
        ({"n2", "n3"}, 2, "error", "at least 2 nodes (job.min_nodes) but partition 'p' has 1"),
    ],
)
def test_quarantine_below_nodes_is_fine_down_to_min_nodes(tmp_path, excluded, min_nodes, level, words):
    job = {"nodes": 3, "procs_per_node": 1, **({"min_nodes": min_nodes} if min_nodes else {})}
    loaded = load_run(spec(tmp_path, job=job, train={"global_batch_size": 6}))
    _, found = facts(excluded, min_nodes)
    findings: list[Finding] = _decide(loaded, found)
    assert any(f.level == level and words in f.message for f in findings), findings
    if level == "info":
        assert not any(f.level == "error" for f in findings), findings


def test_min_nodes_asks_for_a_range_of_whole_nodes_and_checks_what_it_got(tmp_path):
    from jobgen.launch.render import render, sbatch_directives

    loaded = load_run(spec(tmp_path, job={"nodes": 3, "min_nodes": 2}, train={"global_batch_size": 12}))
    assert {"--nodes=2-3", "--exclusive"} <= set(sbatch_directives(loaded))
    text = render(loaded)
    assert "SLURM_JOB_NUM_NODES < 2 || SLURM_JOB_NUM_NODES > 3" in text
    assert '--expected-world-size "$((SLURM_NNODES * 2))"' in text
    fixed = load_run(spec(tmp_path, job={"nodes": 3}))
    assert "--nodes=3" in sbatch_directives(fixed) and "--exclusive" not in sbatch_directives(fixed)
