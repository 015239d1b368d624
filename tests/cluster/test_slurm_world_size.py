"""A run that changes world size on the dev cluster and keeps its global batch
(``train.global_batch_size``; grad_accum is derived for each task):

- one run stopped (Slurm's lead-time signal, sent by hand) and resubmitted on 4 processes
  (2 nodes x 2), then 2 (1 x 2), then 3 (3 x 1), under DDP (and FSDP2, in the full suite):
  every step's loss is that of an uninterrupted run on 4 processes, so every step saw the same samples (none lost, none
  repeated, the epoch's end included), and status shows each task's world and batch;
- ``job.min_nodes``: a 3-node run (``--nodes=2-3 --exclusive``) loses node3 to quarantine and
  its next task runs on the 2 nodes left instead of waiting, its losses those of an uninterrupted
  run on one node of 2 processes.
"""

from __future__ import annotations

import pytest

from helpers import (
    exit_record,
    jobgen,
    last_step,
    losses,
    node,
    node_range,
    running_task,
    submit,
    wait_for,
    wait_until_gone,
)
from helpers import status as run_status
from jobgen.base.exit_codes import ExitCode
from jobgen.runs import quarantine
from jobgen.runs.jsonl_records import read_jsonl
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

GLOBAL_BATCH = 12  # divides into micro-steps of 4, 2 and 3 ranks x 1 sequence
MAX_STEPS = 40  # 480 samples of the example's 400: the run crosses an epoch's end


def keys(**more: object) -> dict[str, object]:
    return {"micro_batch_size": 1, "global_batch_size": GLOBAL_BATCH, "max_steps": MAX_STEPS, **more}


def exits(run) -> list[dict]:
    return [r for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "exit"]


def signal_after(run, job: int, step: int) -> int:
    """Slurm's lead-time signal, by hand, once ``run`` has logged ``step``: the task saves at
    its next step boundary and ends (a planned stop). Returns the task's job id."""
    task = running_task(job, 1, timeout=240)
    wait_for(lambda: last_step(run, task) >= step, 240, f"step {step} of {run.name}", interval=0.1)
    slurm.cancel(f"{job}_1", signal="USR1", batch_only=True)
    return task


def stopped(run, task: int) -> dict:
    """The task's exit record, once the job has left the queue (a resubmission of a run whose
    job is still ending is refused as busy)."""
    record = wait_for(lambda: exit_record(run, task), 180, f"{run.name}'s task {task} to save and stop")
    assert record["exit_code"] == ExitCode.SIGNALLED, record
    wait_until_gone([task])
    return record


def assert_same_losses(run, reference) -> None:
    got, expected = losses(run), losses(reference)
    assert sorted(got) == sorted(expected) == list(range(1, MAX_STEPS + 1)), (sorted(got), sorted(expected))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=2e-3), (run.name, step, got[step], expected[step])


# FSDP2 in the full suite (tests/distributed/test_global_batch.py resumes FSDP2 on another
# world size in CI): the two side by side take twice the cores of this 2-core CI machine.
@pytest.mark.parametrize("parallelism", ["ddp", pytest.param("fsdp", marks=pytest.mark.full)])
def test_a_run_moves_from_4_to_2_to_3_ranks_with_its_global_batch(cluster, cluster_run, tmp_path, parallelism):
    # 2 nodes x 2 processes, then 1 x 2, then 3 x 1 (the local site: 2 CPUs a process pair).
    worlds = [{"nodes": 2, "procs_per_node": 2}, {"nodes": 1, "procs_per_node": 2}, {"nodes": 3, "procs_per_node": 1}]
    reference = cluster_run(f"ref-{parallelism}", **worlds[0], **keys(parallelism=parallelism))
    submit(reference.spec)
    chain = cluster_run(f"ws-{parallelism}", **worlds[0], **keys(parallelism=parallelism))
    job = submit(chain.spec)
    for stage, stop_at in enumerate((4, 16)):
        stopped(chain.path, signal_after(chain.path, job, stop_at))
        if stage == 0:
            refused_without_global_batch(tmp_path, cluster_run, chain.path, worlds[1], parallelism)
        job = submit(cluster_run(f"ws-{parallelism}", **worlds[stage + 1], **keys(parallelism=parallelism)).spec)
        assert len(exits(chain.path)) == stage + 1
    wait_for(lambda: (chain.path / "done").exists(), 300, f"{chain.path.name} to finish")
    wait_for(lambda: (reference.path / "done").exists(), 300, f"{reference.path.name} to finish")
    assert_same_losses(chain.path, reference.path)
    shapes = [(t["world_size"], t["global_batch"]) for t in run_status(chain.path)["tasks"]]
    assert shapes == [(4, GLOBAL_BATCH), (2, GLOBAL_BATCH), (3, GLOBAL_BATCH)], shapes
    starts = [r["start_step"] for r in read_jsonl(chain.path / "tasks.jsonl") if r["event"] == "first_step"]
    assert starts == [0, *(e["end_step"] for e in exits(chain.path)[:-1])], starts


def refused_without_global_batch(tmp_path, cluster_run, run, world: dict, parallelism: str) -> None:
    """The same run resubmitted on ``world`` with a fixed grad_accum and no global_batch_size
    (2 ranks x 1 x 3 = 6 against the checkpoint's 12): submit refuses it, naming the keys and
    the checkpoint, before anything is queued, and the run's spec stays as it was."""
    before = (run / "spec.json").read_text()
    changed = cluster_run(
        run.name, **world, parallelism=parallelism, micro_batch_size=1, grad_accum=3, max_steps=MAX_STEPS
    )
    out = jobgen("submit", str(changed.spec))
    words = out.stdout + out.stderr
    assert out.returncode != 0 and "train.global_batch_size" in words, words
    for part in ("global batch of 12", "this task's is 6", "train.allow_batch_change", "the checkpoint step-"):
        assert part in words, (part, words)
    assert (run / "spec.json").read_text() == before
    assert not slurm.jobs_named(run.name), "nothing queued"


def test_min_nodes_continues_on_the_nodes_quarantine_leaves(cluster, cluster_run):
    run = cluster_run("fewer", nodes=3, procs_per_node=1, array=2, job={"min_nodes": 2}, **keys(max_steps=24))
    # Task 1 on all 3: an earlier test's job may still be ending.
    wait_for(lambda: all(n.get("State") == "IDLE" for n in slurm.nodes()), 120, "every node idle")
    job = submit(run.spec)
    # The reference: the same batch on one node of 2 processes, beside task 1 on the node the run loses.
    reference = cluster_run("fewer-ref", procs_per_node=2, job={"nodelist": [node(3)]}, **keys(max_steps=24))
    submit(reference.spec)

    first = stop_after_quarantine(run.path, job)
    assert first["world_size"] == 3 and first["grad_accum"] == 4, first
    # The trainer writes `done` before the task's exit record (jobgen.runtime appends it as the
    # task ends), and Slurm counts the task completed later still: wait for each in turn.
    wait_for(lambda: (run.path / "done").exists(), 300, "the run to finish on 2 nodes")
    second = wait_for(lambda: exits(run.path)[1:], 60, "task 2's exit record")[-1]
    wait_until_gone([job])
    assert (second["world_size"], second["grad_accum"], second["exit_code"]) == (2, 6, ExitCode.OK), second

    # Accounting may name a task's state a moment after it has left the queue.
    def completed() -> list[dict] | None:
        tasks = run_status(run.path)["tasks"]
        return tasks if all(t["state"] == "COMPLETED" for t in tasks) else None

    tasks = wait_for(completed, 60, lambda: f"both tasks COMPLETED: {run_status(run.path)['tasks']}")
    assert [t["nodes"] for t in tasks] == [node_range(1, 3), node_range(1, 2)], tasks
    wait_for(lambda: (reference.path / "done").exists(), 300, "the reference to finish")
    got, expected = losses(run.path), losses(reference.path)
    assert sorted(got) == sorted(expected) == list(range(1, 25))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=2e-3), (step, got[step], expected[step])


def stop_after_quarantine(run, job: int) -> dict:
    """The third node quarantined while task 1 trains (as the batch script does when a node fails: the
    run's pending task excludes it), then task 1 stopped by the lead-time signal."""
    task = running_task(job, 1, timeout=240)
    wait_for(lambda: last_step(run, task) >= 3, 240, "task 1's step 3")
    rundir = RunDir(run)
    quarantine.add(rundir, {node(3): "taken out by the test"}, f"{job}_1")
    assert quarantine.exclude_from_pending(rundir, rundir.load_spec())  # task 2, pending
    return stopped(run, signal_after(run, job, 3))
