"""The job's supervisor (issue 47, jobgen.job) on the dev cluster, where it does more than the
batch script's bash did: a run that ends (finished, or stopped by a failure every task would
repeat) ends its array, its queued tasks cancelled with the reason instead of each taking the
nodes from the queue only to exit; and your own program crashing the same way in two tasks in a
row stops the run instead of burning every task of the array."""

from __future__ import annotations

import json
import time

import pytest

from helpers import (
    array_task_records,
    assert_cancelled,
    command_spec,
    kill_node,
    last_step,
    log_time,
    ran_tasks,
    revive_node,
    running_task,
    slurm_setting,
    status,
    submit,
    wait_for,
    wait_until_gone,
)
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.lifecycle]


def test_a_run_finished_in_task_1_cancels_its_queued_tasks_with_the_reason(cluster_run):
    run = cluster_run("finish-early", nodes=1, procs_per_node=1, array=3, max_steps=6)
    array = submit(run.spec)
    wait_for(lambda: (run.path / "done").exists(), 240, "the run to finish in task 1")
    done = (run.path / "done").stat().st_mtime
    finished = wait_for(lambda: status(run.path)["state"] == "finished" and time.time(), 60, "status to say finished")
    wait_until_gone([array], timeout=60)
    assert_cancelled(array, ["2", "3"], "the run finished in task ")
    assert array_task_records(array)["1"]["state"] == "COMPLETED"
    assert ran_tasks(run.path, array) == ["1"]  # tasks 2 and 3 never took the nodes
    log = next(run.path.glob("logs/finish-early-*.out")).read_text()
    assert "cancelled the array's pending task(s)" in log, log[-2000:]
    print(f"finish: status said finished {finished - done:.1f} s after the done marker")


CRASHING = """\
import sys
print("loading the optimizer state", flush=True)
raise RuntimeError(f"optimizer state does not match the model (object at {hex(id(sys))})")
"""


def test_your_program_crashing_the_same_way_twice_stops_the_run(cluster, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASHING)
    spec = command_spec(tmp_path, "own-crash", script, [], nodes=1, procs_per_node=1, array=5)
    run = tmp_path / "runs" / "own-crash"
    array = submit(spec)
    wait_until_gone([array], timeout=300)

    marker = json.loads((run / "failed").read_text())
    assert marker["reason"] == (
        "crashed twice the same way (exit 1 (RuntimeError: optimizer state does not match the model (object at …)))"
    ), marker
    assert ran_tasks(run, array) == ["1", "2"]  # the second crash stopped the run; 3 to 5 were cancelled
    assert_cancelled(array, ["3", "4", "5"], "the run stopped in task ")
    assert [array_task_records(array)[i]["state"] for i in "12"] == ["FAILED", "FAILED"]
    assert status(run)["state"] == "failed"


def test_a_lost_node_is_found_by_the_supervisor_long_before_slurm_does(cluster_run, cluster):
    """SlurmdTimeout at Slurm's default (300 s): the supervisor finds the dead node in seconds
    (its ranks' peers ended, its slurmd does not answer), quarantines it and relaunches on the
    spare, while Slurm still counts the node as up and in the allocation."""
    first_node = cluster.nodes[0]  # the batch host: its loss would end the allocation
    run = cluster_run(
        "lost-node",
        nodes=2,
        procs_per_node=1,
        array=2,
        max_steps=40,
        save_every_steps=20,
        snapshot_every_steps=2,
        job={"in_job_restarts": 2, "spare_nodes": 1},
    )
    with slurm_setting("SlurmdTimeout", "300"):
        array = submit(run.spec)
        task = running_task(array, 1)
        allocation = slurm.hostnames(slurm.show_job(task)[0]["NodeList"])
        assert allocation[0] == first_node, allocation
        victim, spare = allocation[1], allocation[2]
        wait_for(lambda: last_step(run.path, task) >= 8, 180, "task 1 past a few snapshots")
        log = run.path / "logs" / f"lost-node-{task}.out"
        try:
            kill_node(victim)
            lost_at = time.time()
            line = wait_for(
                lambda: next((x for x in log.read_text().splitlines() if "relaunching the program" in x), None),
                120,
                "the relaunch",
            )
            relaunched = log_time(line) - lost_at
            (record,) = [r for r in slurm.nodes() if r.get("NodeName") == victim]
            assert "DOWN" not in record.get("State", ""), record  # Slurm has not noticed yet
            assert relaunched <= 30, (relaunched, log.read_text()[-3000:])
            # The pending task 2 keeps off the lost node and asks for the 2 nodes the 3-node cluster
            # has left, not for 2 + 1 spare it would wait for for ever.
            (pending,) = [r for r in slurm.show_job(array) if r.get("JobState") == "PENDING"]
            assert pending["ExcNodeList"] == victim and pending["NumNodes"].split("-")[0] == "2", pending
            wait_for(lambda: (run.path / "done").exists(), 300, "the relaunched run to finish")
        finally:
            revive_node(cluster, victim)
    wait_until_gone([array], timeout=180)
    text = log.read_text()
    assert f"node {victim} is lost: its slurmd at " in text and f"this launch trains on {first_node},{spare}" in text
    quarantined = json.loads((run.path / "quarantine.json").read_text())["nodes"]
    assert list(quarantined) == [victim] and "lost: its slurmd" in quarantined[victim]["reason"], quarantined
    print(f"lost node: {victim} killed, the supervisor relaunched on {first_node},{spare} {relaunched:.0f} s later")
