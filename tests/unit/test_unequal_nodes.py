"""Unequal processes per node (``job.procs_per_node = [3, 1]``): the spec's shape and its
checks, each named by file and key; the one world-size helper every caller uses; the batch
script (the counts as a bash array indexed by $SLURM_NODEID, a static rendezvous whose node
ranks are the allocation's node order); plan, status, preflight and doctor showing the counts.
The dev cluster runs it: tests/cluster/test_slurm_unequal_nodes.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import pytest

from fake_models import fake_model
from helpers import DATA, check_shell, jobgen, run_spec, spec_issues
from jobgen.cli.main import _procs_per_node
from jobgen.launch.doctor import doctor_spec
from jobgen.launch.preflight import _ClusterFacts, _decide
from jobgen.launch.render import render, sbatch_directives
from jobgen.model.parallelism import STRATEGIES, shard_size_problem
from jobgen.plan.inputs import PlanInputs
from jobgen.report.status import RunStatus
from jobgen.report.status_format import format_status
from jobgen.spec.loader import load_run
from jobgen.spec.tables.run import JobSpec, layout_text

# A CPU site whose nodes have the CPUs for 3 processes (the dev cluster's nodes have 4).
SITE = {"profile": "local", "slurm": {"cpus_per_node": 4}}


def spec(tmp_path: Path, *, job=None, train=None, site=None) -> Path:
    job = {"time": "1h", "nodes": 2, "procs_per_node": [3, 1], "runs_root": str(tmp_path / "runs"), **(job or {})}
    train = {"micro_batch_size": 1, **(train or {})}
    return run_spec(
        tmp_path, "uneq", site=site or SITE, job=job, model={"path": "org/m"}, data={"path": str(DATA)}, train=train
    )


# ---------------------------------------------------------------- the spec


def test_a_list_gives_each_node_its_count_and_the_world_is_their_sum(tmp_path):
    loaded = load_run(spec(tmp_path))
    assert loaded.node_procs == (3, 1) and loaded.world_size == 4 and loaded.world_sizes == [4]
    assert loaded.procs_per_node == 3  # what every node's request covers
    assert loaded.layout == "2 nodes with 3 + 1 processes"
    job = loaded.run.job
    assert job.unequal_nodes and job.node_procs(8) == (3, 1) and job.world_size(8) == 4


def test_one_number_still_means_every_node_and_the_site_default_when_unset():
    job = JobSpec(name="x", time="1h", nodes=3, procs_per_node=2)
    assert job.node_procs(8) == (2, 2, 2) and job.world_size(8) == 6 and job.world_size(8, nodes=2) == 4
    unset = JobSpec(name="x", time="1h", nodes=2)
    assert unset.node_procs(4) == (4, 4) and not unset.unequal_nodes
    assert layout_text((2, 2)) == "2 node(s) x 2 process(es)"


@pytest.mark.parametrize(
    "job, key, words",
    [
        pytest.param({"procs_per_node": [3, 1, 1]}, "job", "gives 3 node(s) their processes, job.nodes is 2", id="len"),
        pytest.param({"min_nodes": 1}, "job", "job.min_nodes = 1 lets a task run on fewer", id="min-nodes"),
        pytest.param({"procs_per_node": [3, 0]}, "job.procs_per_node", "entry 1 (0) must be from 1 to 256", id="zero"),
        pytest.param({"procs_per_node": []}, "job.procs_per_node", "an empty list", id="empty"),
        pytest.param({"procs_per_node": [3, "1"]}, "job.procs_per_node", "entry 1 ('1') is not a whole", id="text"),
        pytest.param({"procs_per_node": True}, "job.procs_per_node", "True is not a whole number", id="bool"),
        pytest.param({"procs_per_node": [5, 1]}, "job.procs_per_node[0]", "only 4 CPUs per node", id="cpus"),
    ],
)
def test_a_list_that_does_not_fit_is_refused_naming_the_key(tmp_path, job, key, words):
    issues = spec_issues(spec(tmp_path, job=job))
    assert key in issues and words in issues[key], issues


def test_an_entry_above_the_sites_gpus_is_named_by_its_index(tmp_path):
    site = {"profile": "local", "slurm": {"cpus_per_node": 8, "gpus_per_node": 2}}
    issues = spec_issues(spec(tmp_path, job={"procs_per_node": [2, 3], "nodelist": ["n1", "n2"]}, site=site))
    assert issues == {"job.procs_per_node[1]": "3 processes per node but the site has 2 GPUs per node"}


def test_errors_name_the_run_file(tmp_path):
    out = jobgen("validate", str(spec(tmp_path, job={"min_nodes": 1})))
    assert out.returncode != 0 and f"{tmp_path / 'run.toml'}: job: job.min_nodes = 1" in out.stdout + out.stderr


@pytest.mark.parametrize(
    "train, words",
    [
        pytest.param({"parallelism": "hsdp"}, "hsdp shards within a node by default", id="default-shard"),
        pytest.param({"parallelism": "hsdp", "shard_size": 2}, "must divide every node's processes", id="2-of-3"),
    ],
)
def test_hsdp_needs_a_shard_size_that_divides_every_node(tmp_path, train, words):
    issues = spec_issues(spec(tmp_path, train=train))
    assert list(issues) == ["train.shard_size"] and words in issues["train.shard_size"], issues
    assert "job.procs_per_node = [3, 1]" in issues["train.shard_size"]


@pytest.mark.parametrize(
    "train",
    [{"parallelism": "ddp"}, {"parallelism": "fsdp"}, {"parallelism": "hsdp", "shard_size": 1}],
    ids=["ddp", "fsdp", "hsdp-1"],
)
def test_ddp_fsdp_and_hsdp_with_a_dividing_shard_size_are_fine(tmp_path, train):
    assert load_run(spec(tmp_path, train=train)).world_size == 4


def test_hsdp_default_shard_size_is_fine_when_the_listed_nodes_are_equal(tmp_path):
    loaded = load_run(spec(tmp_path, job={"procs_per_node": [2, 2]}, train={"parallelism": "hsdp"}))
    assert loaded.world_size == 4


def test_shard_size_problem_and_shard_size_take_each_nodes_count():
    assert shard_size_problem("hsdp", 8, [4, 2, 2], 2) is None
    assert "divide every node's processes" in shard_size_problem("hsdp", 8, (4, 2, 2), 4)
    assert shard_size_problem("hsdp", 6, 2, None) is None  # one count for every node: as before
    assert shard_size_problem("fsdp", 4, [3, 1], None) is None
    assert STRATEGIES["hsdp"].shard_size(8, [4, 2, 2], 2) == 2 and STRATEGIES["fsdp"].shard_size(4, [3, 1], None) == 4


# ---------------------------------------------------------------- the batch script


def test_the_script_asks_one_allocation_and_starts_each_node_with_its_count(tmp_path):
    loaded = load_run(spec(tmp_path))
    directives = list(sbatch_directives(loaded))
    assert "--nodes=2" in directives and "--ntasks-per-node=1" in directives and "--cpus-per-task=4" in directives
    text = render(loaded)
    assert "# train: 2 nodes with 3 + 1 processes = world size 4." in text
    assert "NODE_PROCS=(3 1)" in text and "NODE_THREADS=(1 4)" in text and "TASK_WORLD_SIZE=4\n" in text
    assert '--nproc-per-node="$NPROC"' in text and "--rdzv-backend=static" in text
    assert '--node-rank="$SLURM_NODEID"' in text and "IS_HOST" not in text
    assert "--expected-world-size 4\n" in text


def test_equal_nodes_keep_c10d(tmp_path):
    text = render(load_run(spec(tmp_path, job={"procs_per_node": 2})))
    assert "--rdzv-backend=c10d" in text and '--rdzv-conf="is_host=$IS_HOST"' in text
    assert "NODE_PROCS" not in text and "--node-rank" not in text


def heredoc(text: str, delimiter: str) -> str:
    """The body of the script's here-document ``<<'DELIMITER'``: a script run on every node."""
    return re.search(rf"<<'{delimiter}' \|\| true\n(.*?)\n{delimiter}\n", text, re.S).group(1)


@pytest.mark.parametrize("node_id, nproc, threads", [(0, 3, 1), (1, 1, 4)])
def test_each_node_runs_torchrun_with_its_own_count(tmp_path, node_id, nproc, threads):
    """The node script as srun runs it on node ``node_id``, with a python (that starts torchrun) that
    prints what it got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text('#!/bin/bash\necho "OMP=$OMP_NUM_THREADS"\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    node_script = "ipv4_on() { echo 10.0.0.9; }\n" + heredoc(render(load_run(spec(tmp_path))), "NODE")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_NODEID": str(node_id),
        "SLURMD_NODENAME": f"node{node_id + 1}",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "7",
        "JOBGEN_IFNAME": "eth0",
        "JOBGEN_HEAD_NODE": "node1",
        "JOBGEN_RDZV_ENDPOINT": "10.0.0.9:29507",
        "JOBGEN_RUN_DIR": str(tmp_path / "run"),
        "TORCH_ELASTIC_WORKER_IDENTICAL": "1",
    }
    out = subprocess.run(["bash", "-c", node_script], env=env, capture_output=True, text=True, check=True).stdout
    args = out.splitlines()
    assert args[0] == f"OMP={threads}"
    assert args[1:3] == ["-m", "jobgen.runtime.torchrun"], args
    assert f"--nproc-per-node={nproc}" in args and f"--node-rank={node_id}" in args, args
    assert "--rdzv-backend=static" in args and "--rdzv-endpoint=10.0.0.9:29507" in args
    assert args[-2:] == ["--expected-world-size", "4"]


def test_the_node_scripts_pass_shellcheck(tmp_path):
    """shellcheck sees a here-document as text: the node and probe scripts are checked alone."""
    site = {"profile": "local", "slurm": {"cpus_per_node": 4, "gpus_per_node": 4}}
    text = render(load_run(spec(tmp_path, site=site, job={"nodelist": ["n1", "n2"]})))
    for delimiter in ("NODE", "PROBE"):
        check_shell("#!/bin/bash\nipv4_on() { :; }\n" + heredoc(text, delimiter) + "\n", tmp_path, f"{delimiter}.sh")
    assert "NPROC=${NODE_PROCS[$SLURM_NODEID]}" in heredoc(text, "PROBE")


# ---------------------------------------------------------------- plan, status, preflight, doctor


def test_plan_shows_the_counts_and_suggests_no_node_counts_or_default_hsdp(tmp_path):
    path = run_spec(
        tmp_path,
        "memplan",
        site={"profile": "local", "slurm": {"cpus_per_node": 4, "device_memory": "1GiB"}},
        job={"time": "1h", "nodes": 2, "procs_per_node": [3, 1], "runs_root": str(tmp_path / "runs")},
        model={"path": fake_model(tmp_path / "m")},
        data={"path": DATA, "max_length": 512},
        train={"micro_batch_size": 1},
    )
    out = jobgen("plan", str(path)).stdout
    assert "ddp on 4 rank(s) (3 + 1 per node)" in out, out
    assert "job.nodes =" not in out and '"hsdp"' not in out, out


def test_host_memory_and_shards_follow_the_largest_node():
    inputs = PlanInputs(parallelism="hsdp", world_size=4, nodes=2, node_procs=(3, 1), shard_size=1)
    assert inputs.ranks_per_node == 3 and inputs.shard == 1
    assert PlanInputs(parallelism="fsdp", world_size=4, nodes=2, node_procs=(3, 1)).shard == 4


def test_status_shows_the_counts():
    status = RunStatus(run_dir="/r", name="r", program="train", state="running", step=3, max_steps=9)
    status.node_procs = [3, 1]
    assert "nodes    2 nodes with 3 + 1 processes = world size 4" in format_status(status).splitlines()


def test_preflight_names_each_nodes_count_in_slurms_order(tmp_path):
    nodes = {f"n{i}": {"NodeName": f"n{i}", "CPUTot": "4", "State": "IDLE", "Gres": ""} for i in (1, 2, 3)}
    part = {"PartitionName": "debug", "Default": "YES", "MaxTime": "UNLIMITED", "Nodes": "n[1-3]", "State": "UP"}

    def said(nodelist: list[str]) -> list[str]:
        loaded = load_run(spec(tmp_path / "-".join(nodelist or ["any"]), job={"nodelist": nodelist}))
        wanted = frozenset(nodelist)
        facts = _ClusterFacts(
            (23, 2), {"debug": part}, "debug", part, None, frozenset(nodes), frozenset(), wanted, nodes
        )
        return [f.message for f in _decide(loaded, facts) if f.key == "job.procs_per_node"]

    # The allocation is in the configuration's order, whatever the order nodelist names them in.
    assert said(["n2", "n1"]) == ["processes per node, node by node: n1 3, n2 1"]
    unpinned = said([])
    assert len(unpinned) == 1 and "set job.nodelist" in unpinned[0], unpinned


def test_doctor_takes_a_count_per_node(tmp_path):
    assert _procs_per_node(None, None, "3,1") == [3, 1] and _procs_per_node(None, None, "2") == 2
    with pytest.raises(click.BadParameter, match="one number per node"):
        _procs_per_node(None, None, "3,x")
    doctor = doctor_spec(
        nodes=2, procs_per_node=[3, 1], site_ref=SITE, partition=None, time_limit="5m", base_dir=tmp_path
    )
    assert doctor.node_procs == (3, 1) and doctor.layout == "2 nodes with 3 + 1 processes"
    assert "--expected-world-size 4\n" in render(doctor)
