"""Submission on the real dev cluster (3 nodes, each its own host in --netns mode).

These tests start real jobs through sbatch → srun → torchrun; they share one
cluster (the session fixture) and each uses its own runs root under tmp_path.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest

from helpers import (
    DATA,
    doctor_spec,
    jobgen,
    node,
    node_range,
    run_spec,
    status,
    wait_for,
    wait_until_gone,
    write_spec,
)
from helpers import submitted_job_id as job_id_of
from jobgen.base.paths import EXAMPLES_DIR
from jobgen.slurm import client as slurm

pytestmark = pytest.mark.slurm


def final_state(job_id: int) -> dict[str, str]:
    (record,) = slurm.show_job(job_id)
    return record


@pytest.mark.full  # CI: test_doctor_command_reports_every_rank runs the same doctor job
def test_doctor_example_runs_world_size_four_on_two_hosts(cluster, tmp_path: Path):
    env = {"HOME": str(tmp_path)}  # examples/doctor.toml keeps its runs under ~/jobgen-runs
    proc = jobgen("submit", str(EXAMPLES_DIR / "doctor.toml"), env=env, check=True)
    job_id = job_id_of(proc.stdout)
    wait_until_gone([job_id])
    run = tmp_path / "jobgen-runs" / "doctor"
    log = (run / "logs" / f"doctor-{job_id}.out").read_text()
    verdict = json.loads((run / "doctor.json").read_text())
    assert verdict["ok"], log
    assert verdict["world_size"] == verdict["expected_world_size"] == 4
    assert verdict["nodes"] == [node(1), node(2)]
    assert sorted((r["node"], r["local_rank"]) for r in verdict["ranks"]) == [
        (node(1), 0),
        (node(1), 1),
        (node(2), 0),
        (node(2), 1),
    ]
    # The rendezvous used the head's own eth0 address, not a hostname or localhost.
    head_addr = cluster.node_addrs[node(1)]
    assert f"rendezvous at {head_addr}:" in log
    assert "RESULT: all 4 ranks OK on 2 node(s)" in log
    assert final_state(job_id)["ExitCode"] == "0:0"
    repro = run / "repro" / str(job_id)
    assert (repro / "nodes.txt").read_text().split() == [node(1), node(2)]
    assert "torch==2.13.0" in (repro / "pip-freeze.txt").read_text()
    assert "JobId=" in (repro / "job.txt").read_text()


def test_doctor_command_reports_every_rank(cluster, tmp_path: Path):
    proc = jobgen("doctor", "--nodes", "2", env={"HOME": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: all 4 ranks OK on 2 node(s)" in proc.stdout
    assert re.search(rf"^{node(1)}\s+0,1\s", proc.stdout, re.M), proc.stdout
    assert re.search(rf"^{node(2)}\s+2,3\s", proc.stdout, re.M), proc.stdout


def test_wrong_nic_fails_fast_with_a_clear_message(cluster, tmp_path: Path):
    site = {"profile": "local", "network": {"ifname": "eth9"}}
    spec = doctor_spec(tmp_path, "bad-nic", site=site, nodes=2, procs_per_node=2)
    job_id = job_id_of(jobgen("submit", str(spec), check=True).stdout)
    wait_until_gone([job_id], timeout=90)
    run = tmp_path / "runs" / "bad-nic"
    log = (run / "logs" / f"bad-nic-{job_id}.out").read_text()
    assert "has no IPv4 address on interface 'eth9' (site network.ifname)" in log
    assert final_state(job_id)["ExitCode"] == "3:0"
    # Fast: it failed before the rendezvous, so no rank ever started (and waited for the others).
    assert "rendezvous at" not in log and not (run / "logs" / "ranks" / str(job_id)).exists(), log


PREFLIGHT_CASES = {
    "too-many-nodes": ("nodes = 5", "job.nodes: 5 nodes requested but partition 'debug' has 3"),
    "over-max-time": (
        'partition = "short"\n        time = "10m"',
        "job.time: 10m exceeds partition 'short' MaxTime 5m",
    ),
    "no-partition": ('partition = "gpu-nope"', "partition 'gpu-nope' does not exist"),
    "excluded-away": (
        'nodes = 2\n        exclude = ["{nodes_1_2}"]',
        "2 nodes requested but partition 'debug' has 1 after excluding {node_1}, {node_2}",
    ),
}


def _on_this_cluster(text: str) -> str:
    """``text`` with the names of this worker's dev cluster's nodes in it."""
    return text.format(node_1=node(1), node_2=node(2), node_3=node(3), nodes_1_2=node_range(1, 2))


@pytest.mark.parametrize("case", sorted(PREFLIGHT_CASES))
def test_preflight_refuses_before_queueing(cluster, tmp_path: Path, case: str):
    line, message = (_on_this_cluster(text) for text in PREFLIGHT_CASES[case])
    body = f"""
        site = "local"
        [job]
        name = "pre"
        program = "doctor"
        {line}
        exit_grace = "1m"
        runs_root = "runs"
    """
    if "time =" not in line:
        body = body.replace('exit_grace = "1m"', 'time = "5m"\n        exit_grace = "1m"')
    proc = jobgen("submit", str(write_spec(tmp_path, body)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "runs" / "pre").exists()


def test_preflight_refuses_gpus_the_cluster_lacks_naming_each_nodes(cluster, tmp_path: Path):
    """The dev cluster's nodes have 3, 1 and 2 GPUs: 4 per node (one per process) are nowhere,
    and 3 + 1 processes on the nodes of 3 and 2 GPUs could be split 2 + 2 by Slurm. Both are
    refused before anything is queued, with each node's count."""
    site = {"profile": "local-gpu", "slurm": {"gpus_per_node": 4, "cpus_per_node": 4}}
    proc = jobgen("submit", str(doctor_spec(tmp_path, "gpus", site=site, procs_per_node=4, nodes=2)))
    counts = f"{node(1)} 3, {node(2)} 1, {node(3)} 2"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "site.slurm.gpus_per_node: 4 x gres 'gpu' per node requested for 2 node(s)" in proc.stderr
    assert f"0 node(s) of partition 'debug' have that ({counts})" in proc.stderr, proc.stderr
    site = {"profile": "local-gpu", "slurm": {"gpus_per_node": 3, "cpus_per_node": 4}}
    unequal = doctor_spec(tmp_path, "gpus-uneq", site=site, nodes=2, procs_per_node=[3, 1], nodelist=[node(1), node(3)])
    proc = jobgen("submit", str(unequal))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"3 + 1 processes cannot be placed one per GPU on job.nodelist ({node(1)} 3, {node(3)} 2" in proc.stderr
    assert not (tmp_path / "runs" / "gpus").exists() and not (tmp_path / "runs" / "gpus-uneq").exists()
    assert not slurm.jobs_named("gpus") and not slurm.jobs_named("gpus-uneq")


@pytest.mark.parametrize(
    "variant",
    [
        'exclude = ["{node_3}"]',
        'nodelist = ["{nodes_1_2}"]',
    ],
)
def test_sbatch_test_only_accepts_rendered_variants(cluster, tmp_path: Path, variant: str):
    spec = write_spec(
        tmp_path,
        f"""
        [site]
        profile = "local"
        slurm.hint_nomultithread = true
        slurm.output_per_node = true
        slurm.mem = "1G"
        slurm.exclusive = true
        network.debug = true
        [job]
        name = "variant"
        program = "doctor"
        nodes = 2
        time = "5m"
        exit_grace = "1m"
        runs_root = "runs"
        {_on_this_cluster(variant)}
    """,
    )
    proc = jobgen("submit", str(spec), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "would create/continue" in proc.stdout and "sbatch --parsable" in proc.stdout
    # Slurm itself accepted the exact script: its estimate names the nodes it would use.
    estimate = r"info: sbatch --test-only: Job \d+ to start at \S+ using \d+ processors on nodes node"
    assert re.search(estimate, proc.stdout), proc.stdout
    assert not (tmp_path / "runs").exists()


def test_failed_sbatch_leaves_no_run_directory(cluster, tmp_path: Path):
    from jobgen.launch.submit import submit
    from jobgen.spec.loader import load_run

    spec = load_run(doctor_spec(tmp_path, "ghost", partition="nope"))
    with pytest.raises(slurm.SlurmError, match="partition"):
        submit(spec, skip_preflight=True)
    assert list((tmp_path / "runs").iterdir()) == []


def test_array_after_chaining_and_kill_switch_burn_through(cluster, tmp_path: Path):
    """An array chained --after a running job waits for it; with the kill switch set,
    every task exits within seconds, one task at a time (%1), before srun."""
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text("{}\n")
    blocker = doctor_spec(tmp_path, "blocker", filename="blocker.toml", nodes=2, procs_per_node=2)
    train = write_spec(
        tmp_path,
        """
        site = "local"
        [job]
        name = "chained"
        time = "5m"
        exit_grace = "1m"
        array = 3
        runs_root = "runs"
        [model]
        path = "model"
        [data]
        path = "data.jsonl"
    """,
        name="train.toml",
    )
    first = job_id_of(jobgen("submit", str(blocker), check=True).stdout)
    second = job_id_of(jobgen("submit", str(train), "--after", str(first), check=True).stdout)
    run = tmp_path / "runs" / "chained"
    jobgen("stop", str(run), check=True)
    assert (run / "switches" / "kill").exists()

    # The scheduler gives the reason on its next pass; until then it reads "None".
    def waiting_on_the_blocker() -> list[slurm.QueueEntry]:
        pending = slurm.queue([second])
        assert pending and all(e.state == "PENDING" for e in pending), pending
        return pending if any(e.reason == "Dependency" for e in pending) else []

    wait_for(waiting_on_the_blocker, 20, lambda: f"reason Dependency: {slurm.queue([second])}")

    # Resubmitting while the array is queued would start a second writer of the same run.
    refused = jobgen("submit", str(train))
    assert refused.returncode == 2 and f"--after {second}" in refused.stderr
    third = job_id_of(jobgen("submit", str(train), "--after", str(second), "--array", "2", check=True).stdout)

    wait_until_gone([first, second, third], timeout=240)
    jobs = json.loads((run / "jobs.json").read_text())
    assert [(j["job_id"], j["after"], j["array"]) for j in jobs] == [(second, first, 3), (third, second, 2)]
    assert [j["options"][0] for j in jobs] == ["--array=1-3%1", "--array=1-2%1"]

    logs = sorted((run / "logs").glob("chained-*.out"))
    assert len(logs) == 5, [p.name for p in logs]
    for path in logs:
        text = path.read_text()
        assert "kill switch" in text and "not starting" in text, text
        assert "rendezvous" not in text
    # One task at a time (%1), and the first only after the blocker ended (afterany).
    (blocker_record,) = slurm.show_job(first)
    tasks = sorted(slurm.show_job(second), key=lambda r: int(r["ArrayTaskId"]))
    assert [r["ArrayTaskId"] for r in tasks] == ["1", "2", "3"]
    assert all(r["JobState"] == "COMPLETED" and r["ExitCode"] == "0:0" for r in tasks)
    assert tasks[0]["StartTime"] >= blocker_record["EndTime"]
    for before, after in itertools.pairwise(tasks):
        assert after["StartTime"] >= before["EndTime"]
    # Burning through: no task launched anything.
    for record in tasks:
        assert not (run / "logs" / "ranks" / record["JobId"]).exists(), record
    view = status(run)
    assert view["state"] == "stopped"
    assert len(view["tasks"]) == 5 and {t["state"] for t in view["tasks"]} == {"COMPLETED"}


def test_odd_run_dir_and_extra_sbatch_value_reach_slurm_literally(cluster, tmp_path: Path):
    """A relative runs_root under a directory with a space, '#', '%', quotes (issue 9, defect 8),
    and an extra_sbatch value with a space and '#' (defect 9): sbatch reads the quoted
    #SBATCH values whole, the batch log lands in the literal run dir, the job runs there."""
    import subprocess

    here = tmp_path / "my runs #1 %j 50%% 'q\""
    here.mkdir()
    site = {"profile": "local", "slurm": {"extra_sbatch": ["--comment=my run #1"]}}
    spec = doctor_spec(here, "odd", site=site, nodes=1, procs_per_node=1)
    job_id = job_id_of(jobgen("submit", str(spec), check=True).stdout)
    shown = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", str(job_id)], capture_output=True, text=True, check=False
    ).stdout
    wait_until_gone([job_id])
    run = here / "runs" / "odd"
    logs = sorted(p.name for p in (run / "logs").iterdir() if p.is_file())
    assert f"odd-{job_id}.out" in logs, logs
    verdict = json.loads((run / "doctor.json").read_text())
    assert verdict["ok"], (run / "logs" / f"odd-{job_id}.out").read_text()
    assert "Comment=my run #1" in shown, shown
    assert final_state(job_id)["ExitCode"] == "0:0"


def test_submit_refuses_a_run_predicted_not_to_fit_before_it_is_queued(cluster, tmp_path: Path, tiny_model: Path):
    """The memory plan in submit's preflight, against the live cluster: a budget the run cannot
    fit is refused with the numbers and a change that would fit, and nothing reaches the queue
    or the disk; the same run under a budget it fits is queued, and so is the refused one when
    the user overrides the plan."""

    def spec(name: str, device_memory: str) -> Path:
        return run_spec(
            tmp_path,
            name,
            filename=f"{name}.toml",
            site={"profile": "local", "slurm": {"device_memory": device_memory}},
            job={"time": "5m", "exit_grace": "1m", "runs_root": str(tmp_path / "runs")},
            model={"path": tiny_model},
            data={"path": DATA, "max_length": 256},
            train={"micro_batch_size": 1, "max_steps": 2},
        )

    def queued() -> set[int]:
        return {entry.job_id for entry in slurm.queue()}

    before = queued()
    refused = jobgen("submit", str(spec("toobig", "100MiB")))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "does not fit" in refused.stderr and "budget 100 MiB" in refused.stderr, refused.stderr
    assert "--ignore-memory-plan" in refused.stderr, refused.stderr
    assert queued() == before
    assert not (tmp_path / "runs" / "toobig").exists()

    fits = jobgen("submit", str(spec("fits", "8GiB")))
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "does not fit" not in fits.stdout + fits.stderr
    forced = jobgen("submit", str(spec("toobig", "100MiB")), "--ignore-memory-plan")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "does not fit" in forced.stderr  # still said, as a warning
    jobs = [job_id_of(fits.stdout), job_id_of(forced.stdout)]
    assert [final_state(job)["JobName"] for job in jobs] == ["fits", "toobig"]
    subprocess.run(["scancel", *map(str, jobs)], check=True)
    wait_until_gone(jobs)
