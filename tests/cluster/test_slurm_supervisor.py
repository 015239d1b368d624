"""The job's supervisor (issue 47, jobgen.job) on the dev cluster, where it does more than the
batch script's bash did: a run that ends (finished, or stopped by a failure every task would
repeat) ends its array, its queued tasks cancelled with the reason instead of each taking the
nodes from the queue only to exit; and your own program crashing the same way in two tasks in a
row stops the run instead of burning every task of the array."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers import command_spec, status, submit, wait_for, wait_until_gone
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.lifecycle]


def task_indices(field: str) -> list[str]:
    """sacct's array task field: ``2``, or ``[2-3%1]`` / ``[3,5-7]`` for tasks cancelled while pending."""
    out = []
    for part in field.strip("[]").split("%")[0].split(","):
        first, _, last = part.partition("-")
        out += [str(i) for i in range(int(first), int(last or first) + 1)] if first.isdigit() else []
    return out


def tasks_by_index(array: int) -> dict[str, tuple[str, str]]:
    """(state, comment) of each task of the array as sacct has it: the tasks cancelled while pending
    are one record (``ARRAY_[2-3%1]``), which jobgen's own reader of sacct leaves out."""
    fields = ["sacct", "-X", "--noheader", "--parsable2", f"--jobs={array}", "--format=JobID,State,Comment"]
    out = {}
    for line in slurm.run(fields).stdout.splitlines():
        job, state, comment = line.split("|", 2)
        for index in task_indices(job.partition("_")[2]):
            out[index] = (state.split()[0], comment)
    return out


def ran_tasks(run: Path) -> list[str]:
    return sorted(json.loads(p.read_text())["array_task"] for p in run.glob("logs/task.*.json"))


def test_a_run_finished_in_task_1_cancels_its_queued_tasks_with_the_reason(cluster_run):
    run = cluster_run("finish-early", nodes=1, procs_per_node=1, array=3, max_steps=6)
    array = submit(run.spec)
    wait_for(lambda: (run.path / "done").exists(), 240, "the run to finish in task 1")
    done = (run.path / "done").stat().st_mtime
    finished = wait_for(lambda: status(run.path)["state"] == "finished" and time.time(), 60, "status to say finished")
    wait_until_gone([array], timeout=60)
    tasks = wait_for(lambda: (t := tasks_by_index(array)) and len(t) == 3 and t, 60, "sacct to know the 3 tasks")
    assert tasks["1"][0] == "COMPLETED", tasks["1"]
    for index in ("2", "3"):
        state, comment = tasks[index]
        assert state == "CANCELLED" and comment.startswith("jobgen: cancelled: the run finished in task "), tasks
    assert ran_tasks(run.path) == ["1"]  # tasks 2 and 3 never took the nodes
    log = next(run.path.glob("logs/finish-early-*.out")).read_text()
    assert "cancelled the array's pending task(s)" in log, log[-2000:]
    print(f"finish: status said finished {finished - done:.1f} s after the done marker")


CRASHING = """\
import sys
print("loading the optimizer state", flush=True)
raise RuntimeError(f"optimizer state does not match the model (object at {hex(id(sys))})")
"""


def test_your_program_crashing_the_same_way_twice_stops_the_run(tmp_path):
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
    assert ran_tasks(run) == ["1", "2"]  # the second crash stopped the run; 3 to 5 were cancelled
    tasks = wait_for(lambda: (t := tasks_by_index(array)) and len(t) == 5 and t, 60, "sacct to know the 5 tasks")
    assert [tasks[i][0] for i in "12345"] == ["FAILED", "FAILED", *["CANCELLED"] * 3], tasks
    assert tasks["5"][1].startswith("jobgen: cancelled: the run stopped in task "), tasks["5"]
    assert status(run)["state"] == "failed"
