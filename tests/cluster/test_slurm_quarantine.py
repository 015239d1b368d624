"""Bad-node quarantine on the dev cluster: a node breaks under a 2-node job, the task ends
FAILED with the node named, the run's next task starts without it, status shows it, and
``jobgen doctor --clear`` releases it once its health check passes.

The node "breaks" as a hung GPU or a stuck file system would break it: its trainer
processes stop (SIGSTOP) mid-training. The ranks on the other node wait for them in the
next all-reduce until train.collective_timeout (20 s here) and fail; the stopped ranks
never report (jobgen.runs.quarantine).
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from helpers import jobgen, last_step, node, running_task, submit, wait_for, wait_until_gone, worker_pids
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def pids_on(run: Path, node: str) -> list[int]:
    """The run's trainer processes on ``node`` (every node of the dev cluster is this machine)."""
    found = []
    for pid in worker_pids(run):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURMD_NODENAME={node}".encode() in environ:
            found.append(pid)
    return found


def task_nodes(array_job_id: int, index: int) -> list[str]:
    entry = next(e for e in slurm.queue([array_job_id]) if e.array_task == str(index))
    return slurm.hostnames(entry.nodes)


def test_a_node_whose_ranks_go_silent_is_quarantined_and_released_by_doctor(cluster_run):
    spec, run = cluster_run("qn", nodes=2, array=2, collective_timeout="20s")
    array = submit(spec)
    first = running_task(array, 1)
    nodes = task_nodes(array, 1)
    wait_for(lambda: last_step(run, first) >= 2, 150, "task 1 to train")
    broken = nodes[1]  # not the head node: the batch script lives on
    stopped = pids_on(run, broken)
    assert len(stopped) == 2, (broken, stopped)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)

    # Task 1 fails with the node named; task 2 starts on the two nodes left.
    second = running_task(array, 2, timeout=180)
    record = json.loads((run / "logs" / f"task.{first}.0.json").read_text())
    assert record["exit_code"] == 20 and record["slurm_exit"] == 20, record
    # Which of the node's two stopped ranks the others saw go silent first is a race: one or both.
    assert re.match(rf"node failure: {broken} quarantined \(its ranks? [\d,]+ went silent", record["reason"]), record
    assert "waited out the 20 s collective timeout" in record["reason"], record
    ended = {r.job_id: r for r in slurm.ended_jobs([array], accounting=False)}
    assert ended[first].state == "FAILED" and f"node failure: {broken}" in ended[first].comment, ended
    assert broken not in task_nodes(array, 2)
    task2 = slurm.show_job(second)[0]
    assert broken in slurm.hostnames(task2["ExcNodeList"]), task2

    held = json.loads((run / "quarantine.json").read_text())["nodes"]
    assert list(held) == [broken] and held[broken]["job"] == f"{array}_1", held
    view = json.loads(jobgen("status", str(run), "--json", check=True).stdout)
    assert [q["node"] for q in view["quarantined"]] == [broken], view
    text = jobgen("status", str(run), check=True).stdout
    assert f"quarantined {broken} since " in text and f"(job {array}_1): its rank" in text, text
    listing = jobgen("status", check=False, env={"JOBGEN_RUNS_ROOT": str(run.parent)}).stdout
    assert f"quarantined node(s) {broken}" in listing, listing

    slurm.cancel(array)
    wait_until_gone([array], timeout=120)
    # The stopped processes went with the job: the node passes the health check again.
    cleared = jobgen("doctor", "--clear", str(run), "--time", "3m")
    assert cleared.returncode == 0, cleared.stdout + cleared.stderr
    assert f"released {broken}" in cleared.stdout, cleared.stdout
    assert json.loads((run / "quarantine.json").read_text())["nodes"] == {}
    # Released: no node held any more (task 1's row still says why it ended, as it should).
    after = jobgen("status", str(run), check=True).stdout
    assert f"quarantined {broken} since" not in after and "quarantined node(s)" not in after, after


def test_a_node_that_fails_the_start_probe_is_quarantined_until_the_doctor_passes(cluster_run, tmp_path):
    """site.health_check fails on one node (a marker file stands for what a site's NHC finds):
    task 1 ends FAILED before torchrun starts, task 2 trains on the nodes left, and
    ``jobgen doctor --clear`` releases node2 only once the check passes there again."""
    markers = tmp_path / "unhealthy"
    markers.mkdir()
    check = f"test ! -e {markers}/$SLURMD_NODENAME || {{ echo 'ECC errors'; false; }}"
    site = {"profile": "local", "health_check": check}
    # The allocation is the first two nodes (node1 and node2): the jobs of an earlier test may
    # still be completing on them.
    wait_for(lambda: all(n.get("State") == "IDLE" for n in slurm.nodes()), 120, "every node idle")
    (markers / node(2)).touch()
    spec, run = cluster_run("qp", nodes=2, array=2, site=site)
    array = submit(spec)
    second = running_task(array, 2, timeout=180)
    records = [json.loads(p.read_text()) for p in (run / "logs").glob("task.*.json")]
    first = next(r for r in records if r["array_task"] == "1")
    assert first["array_task"] == "1" and first["exit_code"] == 20, first
    assert (
        first["reason"]
        == f"node failure: {node(2)} quarantined (failed the start probe: site.health_check failed: ECC errors)"
    )
    assert not list((run / "logs" / "ranks").glob(f"{first['job_id']}/*")), "torchrun started on the broken node"
    assert node(2) not in task_nodes(array, 2)
    wait_for(lambda: last_step(run, second) >= 1, 150, "task 2 to train")
    assert list(json.loads((run / "quarantine.json").read_text())["nodes"]) == [node(2)]
    slurm.cancel(array)
    wait_until_gone([array], timeout=120)

    # The doctor runs the site's check too: node2 stays quarantined until it passes.
    still = jobgen("doctor", "--clear", str(run), "--time", "3m")
    assert (
        still.returncode != 0 and f"start probe failed: {node(2)}=site.health_check failed: ECC errors" in still.stderr
    )
    assert f"still quarantined: {node(2)}" in still.stdout, still.stdout + still.stderr
    (markers / node(2)).unlink()  # repaired
    cleared = jobgen("doctor", "--clear", str(run), "--time", "3m")
    assert cleared.returncode == 0 and f"released {node(2)}" in cleared.stdout, cleared.stdout + cleared.stderr
    assert json.loads((run / "quarantine.json").read_text())["nodes"] == {}
