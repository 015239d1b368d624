"""The program relaunched inside its allocation (issue 35, ``job.in_job_restarts``), on the
real dev cluster: a killed rank costs seconds and the steps since the newest checkpoint, not
a new array task that waits in the queue for nodes; a crash that repeats in the relaunch
stops the run at once with one reason.

The dev sites default to no relaunch (the task-to-task path their other tests exercise);
these runs ask for it in [job]."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers import (
    PLANTED_CRASHES,
    assert_same_training,
    fault_dir,
    jobgen,
    kill_node,
    last_step,
    log_time,
    losses,
    read_jsonl,
    revive_node,
    running_task,
    status,
    submit,
    submitted_job_id,
    wait_for,
    wait_until_gone,
    worker_pids,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.runs.quarantine import TooFewNodes, launch_nodes
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.lifecycle]

MAX_STEPS = 40
SAVE_EVERY = 5
# The killed rank's relaunch resumes from a memory snapshot (every 2 steps), not from the
# disk checkpoint (every 20).
SNAPSHOT_EVERY, DISK_EVERY = 2, 20


def relaunch_lines(run: Path, launch: int) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if r.get("launch", 0) == launch and r.get("event") != "eval"]


def relaunching_run(cluster_run, name: str, max_steps: int, save_every: int, **train: object):
    """A 2-node run that relaunches inside its task (2-task array) and an uninterrupted
    reference (1 node x 2 processes), both submitted; returns them, the array and its task 1
    once that task is a few steps past its first checkpoint."""
    reference = cluster_run(f"{name}-ref", nodes=1, procs_per_node=2, max_steps=max_steps)
    run = cluster_run(
        name,
        nodes=2,
        procs_per_node=1,
        array=2,
        max_steps=max_steps,
        save_every_steps=save_every,
        job={"in_job_restarts": 2},
        **train,
    )
    array = submit(run.spec)
    task = running_task(array, 1)
    submit(reference.spec)
    wait_for(lambda: last_step(run.path, task) >= save_every + 3, 180, "task 1 past its first checkpoint")
    return run, reference, array, task


def test_a_killed_rank_is_relaunched_inside_the_same_task_and_trains_on_exactly(cluster_run):
    run, reference, array, task = relaunching_run(
        cluster_run, "relaunch", MAX_STEPS, DISK_EVERY, snapshot_every_steps=SNAPSHOT_EVERY
    )
    victim = worker_pids(run.path)[-1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()

    # The same array task goes on (task 2 waits): a relaunch, not a requeue. How soon is a
    # figure (printed below, for docs/long-runs.md), not an assertion: it follows the machine's
    # load (8.1 s on an idle one, 48.1 s once beside CI's other workers).
    first = wait_for(lambda: next(iter(relaunch_lines(run.path, 1)), None), 120, "a step of the relaunch")
    assert first["job_id"] == str(task), first
    assert [e.state for e in slurm.queue([array]) if e.array_task == "2"] == ["PENDING"]
    wait_for(lambda: (run.path / "done").exists(), 300, "the relaunched run to finish")
    (resumed,) = [r for r in read_jsonl(run.path / "tasks.jsonl") if r["event"] == "first_step" and r.get("launch")]
    # The step the first launch reached, from its own lines once it is over: a read just after
    # the kill races rank 0, which can still log the step it was finishing (CI saw 1 against 2).
    reached = max(line["step"] for line in relaunch_lines(run.path, 0))
    redone = reached - resumed["start_step"]
    assert resumed["job_id"] == str(task) and 0 <= redone <= SNAPSHOT_EVERY, (reached, resumed)
    # From the snapshot both ranks held, past the checkpoint on disk.
    assert resumed["start_step"] > DISK_EVERY and resumed["start_step"] % SNAPSHOT_EVERY == 0, resumed

    # Every loss either launch logged is the uninterrupted run's.
    wait_for(lambda: (reference.path / "done").exists(), 300, "the reference run to finish")
    assert_same_training(run.path, reference.path, MAX_STEPS)
    expected = losses(reference.path)
    for line in relaunch_lines(run.path, 0):
        assert line["loss"] == pytest.approx(expected[line["step"]], rel=1e-4, abs=1e-5), line

    # One task, with its relaunch, its reason and what it cost; the next task found the run done.
    wait_until_gone([array], timeout=180)
    (row,) = [t for t in status(run.path)["tasks"] if t["job_id"] == task]
    (relaunch,) = row["relaunches"]
    assert relaunch["launch"] == 1 and relaunch["after_exit"] not in (None, 0), relaunch
    assert relaunch["start_step"] == resumed["start_step"] and relaunch["recomputed_steps"] == redone, relaunch
    assert relaunch["seconds_to_first_step"] == pytest.approx(resumed["seconds_to_first_step"]), relaunch
    assert row["jobgen_exit"] == ExitCode.OK, row
    log = (run.path / "logs" / f"relaunch-{task}.out").read_text()
    assert "relaunching the program inside this task (relaunch 1 of at most 2)" in log, log[-3000:]
    print(
        f"relaunch: rank killed at step {reached}, relaunch resumed at {resumed['start_step']} ({redone} redone, "
        f"snapshots every {SNAPSHOT_EVERY} steps, checkpoints every {DISK_EVERY}), "
        f"its first step {first['time'] - killed_at:.1f} s after the kill "
        f"({resumed['seconds_to_first_step']:.1f} s after the relaunch)"
    )


def test_a_crash_that_repeats_in_the_relaunch_stops_the_run_with_one_reason(cluster_run, tmp_path):
    # Every worker crashes in its 3rd optimizer step: with no checkpoint each launch starts at
    # step 0 and meets it at the same step.
    plant = fault_dir(tmp_path, PLANTED_CRASHES)
    run = cluster_run("relaunch-repeat", nodes=1, procs_per_node=2, array=2, max_steps=20, job={"in_job_restarts": 3})
    env = {"PYTHONPATH": str(plant), "CRASH_AT": "3"}  # sbatch exports the submitting environment
    array = submitted_job_id(jobgen("submit", str(run.spec), env=env, check=True).stdout)
    wait_until_gone([array], timeout=300)

    marker = json.loads((run.path / "failed").read_text())
    assert marker["reason"].startswith("crashed twice the same way at step 2 (ValueError at sitecustomize.py:"), marker
    records = {json.loads(p.read_text())["array_task"]: json.loads(p.read_text()) for p in run.path.glob("logs/task.*")}
    task1 = records["1"]
    assert len(task1["restarts"]) == 1 and task1["restarts"][0]["after_exit"] == ExitCode.CRASHED, task1
    assert task1["exit_code"] == ExitCode.CRASHED and task1["reason"].startswith("crashed twice the same way"), task1
    # The failed run ended its array: task 2 was cancelled in the queue and never started (issue 47).
    assert "2" not in records, records
    # Both launches of task 1 took a first step (each from step 0: no checkpoint), then the same crash.
    starts = [(r.get("launch", 0), r["start_step"]) for r in read_jsonl(run.path / "tasks.jsonl")]
    assert starts == [(0, 0), (1, 0)], starts
    log = (run.path / "logs" / f"relaunch-repeat-{task1['job_id']}.out").read_text()
    assert "not relaunching the program: the run is marked failed" in log, log[-3000:]


HANG_TIMEOUT = 20
# The stopped rank's peers must be in a step, not in a save (a save is no step: its heartbeat
# is paused, and a save that hangs meets the collective timeout): saves every 20 steps, and
# the rank stopped a few steps past the first one.
HANG_MAX_STEPS, HANG_SAVE_EVERY = 60, 20


def test_a_stopped_rank_is_found_hung_its_stacks_taken_and_the_launch_relaunched(cluster_run):
    run, reference, array, task = relaunching_run(
        cluster_run, "hang", HANG_MAX_STEPS, HANG_SAVE_EVERY, hang_timeout=f"{HANG_TIMEOUT}s"
    )
    victim = worker_pids(run.path)[-1]
    os.kill(victim, signal.SIGSTOP)  # alive, holding its sockets, answering nothing: a hang
    stopped_at = time.time()
    reached = last_step(run.path, task)

    # Found hung within the timeout and a few seconds of looking, its stacks taken, the
    # launch killed and relaunched in the same task (task 2 still waits).
    first = wait_for(lambda: next(iter(relaunch_lines(run.path, 1)), None), 180, "a step of the relaunch")
    assert first["job_id"] == str(task), first
    assert [e.state for e in slurm.queue([array]) if e.array_task == "2"] == ["PENDING"]
    log = (run.path / "logs" / f"hang-{task}.out").read_text()
    (found,) = [line for line in log.splitlines() if "no rank has taken a step for" in line]
    assert log_time(found) - stopped_at <= HANG_TIMEOUT + 10, (found, stopped_at)
    (stacks,) = (run.path / "hangs").glob(f"*-job{task}.txt")
    dump = stacks.read_text()
    assert f"pid {victim} state T (stopped)" in dump, dump[:3000]
    assert dump.count("=== node ") == 2 and "Thread " in dump, dump[:3000]  # py-spy's dump of each rank
    assert f"stacks in {stacks}" in log, log[-3000:]

    # The relaunch resumed from the newest checkpoint and trained on exactly.
    wait_for(lambda: (run.path / "done").exists(), 300, "the relaunched run to finish")
    (resumed,) = [r for r in read_jsonl(run.path / "tasks.jsonl") if r["event"] == "first_step" and r.get("launch")]
    assert resumed["start_step"] == HANG_SAVE_EVERY and reached < 2 * HANG_SAVE_EVERY, (reached, resumed)
    wait_for(lambda: (reference.path / "done").exists(), 300, "the reference run to finish")
    assert_same_training(run.path, reference.path, HANG_MAX_STEPS)

    # One task: its relaunch after the hang (exit HUNG, the reason), no node blamed for it.
    wait_until_gone([array], timeout=180)
    (row,) = [t for t in status(run.path)["tasks"] if t["job_id"] == task]
    (relaunch,) = row["relaunches"]
    assert relaunch["after_exit"] == ExitCode.HUNG and relaunch["reason"].startswith("hung: no rank took a step"), row
    assert row["jobgen_exit"] == ExitCode.OK, row
    assert not (run.path / "quarantine.json").exists()
    print(
        f"hang: rank stopped at step {reached}, found {log_time(found) - stopped_at:.0f} s later "
        f"(hang_timeout {HANG_TIMEOUT} s), relaunch resumed at {resumed['start_step']}, "
        f"its first step {first['time'] - stopped_at:.1f} s after the stop"
    )


def test_a_lost_node_is_replaced_by_a_spare_inside_the_same_allocation(cluster_run, cluster):

    first_node = cluster.nodes[0]  # the batch script's node: its loss would end the allocation
    # The reference shares the batch script's node, never the one that dies.
    reference = cluster_run("spare-ref", nodes=1, procs_per_node=2, max_steps=MAX_STEPS, job={"nodelist": [first_node]})
    # Snapshots every 2 steps, mirrored to the other node; no checkpoint on disk before step 20.
    run = cluster_run(
        "spare",
        nodes=2,
        procs_per_node=1,
        array=2,
        max_steps=MAX_STEPS,
        save_every_steps=DISK_EVERY,
        snapshot_every_steps=SNAPSHOT_EVERY,
        job={"in_job_restarts": 2, "spare_nodes": 1},
    )
    array = submit(run.spec)
    task = running_task(array, 1)
    (record,) = slurm.show_job(task)
    allocation = slurm.hostnames(record["NodeList"])
    assert len(allocation) == 3 and allocation[0] == first_node, allocation
    trained_on, spare = allocation[:2], allocation[2]
    submit(reference.spec)
    wait_for(lambda: last_step(run.path, task) >= 4 * SNAPSHOT_EVERY, 180, "task 1 past a few snapshots")
    victim = trained_on[1]
    try:
        kill_node(victim)
        lost_at = time.time()

        # The same task goes on, on the spare: the supervisor finds the node lost before Slurm does.
        first = wait_for(lambda: next(iter(relaunch_lines(run.path, 1)), None), 180, "a step of the relaunch")
        assert first["job_id"] == str(task), first
        assert [e.state for e in slurm.queue([array]) if e.array_task == "2"] == ["PENDING"]
        # Slurm takes the node out of the job's NodeList once it notices (SlurmdTimeout: 20 s
        # here), and the job goes on (--no-kill).
        running = wait_for(
            lambda: next((r for r in slurm.show_job(task) if victim not in slurm.hostnames(r["NodeList"])), None),
            120,
            "Slurm to take the lost node out of the job",
        )
        assert running["JobState"] == "RUNNING", running
        # What the batch script asks before each launch: the allocation as Slurm has it now.
        assert launch_nodes(RunDir(run.path), str(task), 2) == [first_node, spare]
        left = rf"2 usable node\(s\) left, the run trains on 3: the allocation holds {first_node}, {spare}$"
        with pytest.raises(TooFewNodes, match=left):
            launch_nodes(RunDir(run.path), str(task), 3)
        wait_for(lambda: (run.path / "done").exists(), 300, "the relaunched run to finish")
    finally:
        revive_node(cluster, victim)

    # The relaunch's world: the same size, its second rank on the spare. It resumed from the
    # newest snapshot: the lost node's rank's own file went with its node (each node keeps its
    # own directory), the copy on the first node was sent to the spare. Every loss is the
    # uninterrupted run's.
    (resumed,) = [r for r in read_jsonl(run.path / "tasks.jsonl") if r["event"] == "first_step" and r.get("launch")]
    # The step the first launch reached, from its own lines once it is over: a read just after
    # the kill races rank 0, which can still log the step it was finishing (CI saw 1 against 2).
    reached = max(line["step"] for line in relaunch_lines(run.path, 0))
    redone = reached - resumed["start_step"]
    assert resumed["job_id"] == str(task) and 0 <= redone < 2 * SNAPSHOT_EVERY, (reached, resumed)
    assert resumed["start_step"] < DISK_EVERY and resumed["start_step"] % SNAPSHOT_EVERY == 0, resumed
    if redone >= SNAPSHOT_EVERY:
        # The node died while the newest snapshot was being mirrored (on these 2 shared cores a
        # mirror can take longer than a step): that one is whole nowhere, the one before it everywhere.
        newer = resumed["start_step"] + SNAPSHOT_EVERY
        log = (run.path / "logs" / f"{run.path.name}-{task}.out").read_text()
        assert f"a snapshot was not kept (step {newer}: mirror:" in log, (reached, resumed)
    ranks = json.loads(RunDir(run.path).rank_map(str(task), 0).read_text())
    assert {int(rank): entry["node"] for rank, entry in ranks.items()} == {0: first_node, 1: spare}, ranks
    wait_for(lambda: (reference.path / "done").exists(), 300, "the reference run to finish")
    assert_same_training(run.path, reference.path, MAX_STEPS)

    # One task with one relaunch: after the node failure, on the first node and the spare; the
    # lost node is quarantined for the run. (Task 2 now excludes it, and this 3-node cluster has
    # no third node left to give it: it would wait for ever to find the run done.)
    slurm.cancel(array)
    wait_until_gone([array], timeout=180)
    tasks = status(run.path)["tasks"]
    rows = [t for t in tasks if t["job_id"] == task]
    assert len(rows) == 1, tasks
    (row,) = rows
    (relaunch,) = row["relaunches"]
    assert relaunch["after_exit"] == ExitCode.NODE_FAILURE and victim in relaunch["reason"], relaunch
    assert relaunch["nodes"] == f"{first_node},{spare}", relaunch
    assert row["jobgen_exit"] == ExitCode.OK, row
    quarantined = json.loads((run.path / "quarantine.json").read_text())["nodes"]
    assert list(quarantined) == [victim], quarantined
    log = (run.path / "logs" / f"spare-{task}.out").read_text()
    assert f"this launch trains on {first_node},{spare}" in log, log[-3000:]
    print(
        f"spare: {victim} lost at step {reached}, the relaunch on {relaunch['nodes']} resumed at "
        f"{resumed['start_step']} ({redone} redone), its first step {first['time'] - lost_at:.1f} s after the loss"
    )
