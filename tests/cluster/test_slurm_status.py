"""`jobgen status` and `jobgen logs` on the dev cluster: pending, running, cancelled, failed
and finished tasks, named as Slurm names them (ARRAYID_TASK), the same rows after Slurm has
forgotten the jobs, and the logs of a live 2-node job followed as it trains.

Slurm forgets an ended job MinJobAge after its end (600 s on the dev cluster); the last part
lowers it to 2 s through slurm.conf and ``scontrol reconfigure``, waits for the controller's
purge, and restores it.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest

from helpers import (
    VENV_BIN,
    jobgen,
    last_step,
    node,
    node_range,
    running_task,
    slurm_setting,
    submit,
    submitted_job_id,
    wait_for,
    wait_until_gone,
)
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def view(run: Path) -> dict:
    return json.loads(jobgen("status", str(run), "--json", check=True).stdout)


def rows(run: Path) -> dict[str, dict]:
    return {t["slurm_id"]: t for t in view(run)["tasks"]}


def slurm_forgets_ended_jobs():
    return slurm_setting("MinJobAge", "2")


def follow_logs(run: Path) -> tuple[subprocess.Popen, list[str]]:
    """`jobgen logs RUN -f` in the background, and the lines it printed so far."""
    proc = subprocess.Popen(
        [str(VENV_BIN / "jobgen"), "logs", str(run), "-f"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return proc, seen


def test_status_and_logs_of_every_kind_of_task_and_after_slurm_forgot(cluster_run, tmp_path):
    """One 2-node array: task 1 trains (followed by `jobgen logs -f`) and is cancelled (it saves
    on SIGTERM), task 2 trains and is aborted (FAILED), task 3 finds the abort switch and does
    not start; then a run that finishes. Slurm then forgets them all; status keeps every row."""
    spec, array = cluster_run("st", nodes=2, array=3)
    first = submit(spec)
    logs, seen = follow_logs(array)
    try:
        task1 = running_task(first, 1)
        name = f"{first}_1"
        wait_for(lambda: last_step(array, task1) >= 2, 150, "task 1 to train")

        live = rows(array)
        assert list(live) == [f"{first}_1", f"{first}_2", f"{first}_3"], live
        running = live[name]
        assert running["state"] == "RUNNING" and running["job_id"] == task1 and running["nodes"] == node_range(1, 2)
        assert running["start_time"] and running["elapsed_seconds"] is not None
        assert running["time_limit_seconds"] == 600 and running["start_step"] == 0 and running["seconds_to_first_step"]
        for index in (2, 3):
            assert live[f"{first}_{index}"]["state"] == "PENDING" and live[f"{first}_{index}"]["reason"]
        text = jobgen("status", str(array), check=True).stdout
        assert f"{name} " in text and "RUNNING" in text and "JobArrayTaskLimit" in text, text

        def every_rank_live() -> bool:
            # "5_1 node2 r3 | ...": which node holds which ranks is the rendezvous's choice.
            where = [line.split(" | ")[0].split() for line in seen if line.startswith(f"{name} node")]
            ranks = {w[2] for w in where if len(w) == 3}
            steps = [line for line in seen if line.startswith(f"{name} ") and " INFO step " in line]
            return ranks == {"r0", "r1", "r2", "r3"} and {w[1] for w in where} == {node(1), node(2)} and bool(steps)

        wait_for(every_rank_live, 120, "every rank's lines and training steps in `jobgen logs -f`")

        # SIGTERM: the trainer saves and leaves; Slurm says CANCELLED. By Slurm's task name: on
        # 22.05 `scancel <the task's own job id>` exits 0 and does nothing ("invalid JobId").
        slurm.cancel(name)
        task2 = running_task(first, 2, timeout=180)
        wait_for(lambda: last_step(array, task2) > 0, 150, "task 2 to train")
        jobgen("abort", str(array), check=True)  # task 2 fails on purpose; task 3 then finds the switch
        wait_until_gone([first], timeout=240)
        assert logs.wait(timeout=60) == 0  # the follow ends by itself once the run stopped
    finally:
        logs.kill()
    assert any(line.startswith(f"{first}_2 | ") and "program exited" in line for line in seen), seen[-5:]
    assert not any(line.split(" | ", 1)[1].startswith("[default") for line in seen if " | " in line)
    only = jobgen("logs", str(array), "--task", "1", "--rank", "3", check=True).stdout.splitlines()
    (where,) = {line.split(" | ")[0] for line in only}
    assert where.startswith(f"{name} node") and where.endswith(" r3") and "rank 3 of 4" in " ".join(only), only

    def ended_as_expected(tasks: dict[str, dict], cancelled_state: str) -> None:
        cancelled, aborted, skipped = (tasks[f"{first}_{i}"] for i in (1, 2, 3))
        assert cancelled["state"] == cancelled_state and cancelled["jobgen_exit"] == 12, cancelled
        assert cancelled["exit_reason"].startswith("SIGTERM (preemption, requeue or scancel)"), cancelled
        assert (aborted["state"], aborted["jobgen_exit"]) == ("FAILED", 11), aborted
        assert aborted["exit_reason"].startswith("abort switch") and aborted["start_step"] > 0, aborted
        assert aborted["recomputed_steps"] == 0 and aborted["start_step"] == cancelled["end_step"]
        assert (skipped["state"], skipped["exit_reason"]) == ("COMPLETED", "abort switch present: not started")

    before = rows(array)
    ended_as_expected(before, "CANCELLED")
    assert before[f"{first}_2"]["comment"].startswith("jobgen: abort switch"), before
    assert view(array)["state"] == "stopped"

    with slurm_forgets_ended_jobs():
        # A run that finishes, while Slurm forgets the array.
        spec, done = cluster_run("fin", max_steps=6)
        waited = jobgen("submit", str(spec), "--wait", timeout=240)
        finished = submitted_job_id(waited.stdout)
        assert waited.returncode == 0 and f"{finished}_1: first step " in waited.stdout, waited.stdout + waited.stderr
        wait_until_gone([finished], timeout=180)
        (fin,) = rows(done).values()
        assert (fin["slurm_id"], fin["state"], fin["jobgen_exit"], fin["end_step"]) == (
            f"{finished}_1",
            "COMPLETED",
            0,
            6,
        )
        assert view(done)["state"] == "finished"
        wait_for(lambda: not slurm.show_job(first) and not slurm.show_job(finished), 180, "Slurm to forget", interval=5)

    after = rows(array)
    assert list(after) == list(before)
    # slurmctld forgot them, its accounting (slurmdbd) did not: the same state as before, the
    # same reason. Without accounting the batch script's record would say COMPLETED (what it
    # told Slurm: a planned stop); tests/unit/test_task_table.py covers that fallback.
    ended_as_expected(after, "CANCELLED" if slurm.accounting_enabled(slurm.config()) else "COMPLETED")
    for key in ("job_id", "start_step", "end_step", "seconds_to_first_step", "nodes", "start_time"):
        assert after[f"{first}_1"][key] == before[f"{first}_1"][key], key
    (fin_after,) = rows(done).values()
    assert (fin_after["state"], fin_after["end_step"]) == ("COMPLETED", 6)
    assert view(done)["state"] == "finished" and view(array)["state"] == "stopped"

    # One line per run without an argument.
    listing = jobgen("status", env={"JOBGEN_RUNS_ROOT": str(tmp_path / "runs")}, check=True).stdout.splitlines()
    assert listing[0].split()[:3] == ["RUN", "STATE", "STEP"], listing
    assert [line.split()[:2] for line in listing[1:]] == [["fin", "finished"], ["st", "stopped"]], listing
    assert listing[1].split()[2] == "6/6" and listing[2].split()[2].endswith("/1000000"), listing
