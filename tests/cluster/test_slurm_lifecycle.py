"""Surviving the cluster, on the real dev cluster: time limits, preemption, switches, crashes.

Every scenario runs the whole chain (sbatch → srun → torchrun → trainer) with the
tiny model and short Slurm time limits, and checks what a person on call would:
exit reasons in the logs, checkpoints present and complete, the step each array
task resumed at, and how much work was lost (recomputed steps).

Slurm checks time limits about once a minute and a 2-node job takes ~20 s to start
training here, so these take minutes. ``pytest -m lifecycle`` runs them all; CI runs
the ones not marked ``full`` (see docs/testing.md).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from helpers import (
    exit_record,
    first_step_record,
    jobgen,
    jobgen_as,
    kill_node,
    last_step,
    read_jsonl,
    revive_node,
    running_task,
    status,
    stop_run,
    submit,
    wait_for,
    wait_until_gone,
    worker_pids,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.lifecycle]


def array_tasks(array_job_id: int) -> list[dict]:
    return sorted(slurm.show_job(array_job_id), key=lambda r: int(r.get("ArrayTaskId", "0").split("-")[0] or 0))


def complete_checkpoints(run: Path) -> list[Path]:
    found = sorted((run / "checkpoints").glob("step-*"))
    for path in found:  # "complete" must mean loadable: metadata, state and every rank's RNG
        assert (path / ".metadata").is_file() and (path / "trainer_state.json").is_file(), path
        assert len(list(path.glob("rng-rank*.pt"))) >= 2, path
    return found


# In CI (docs/testing.md's guarantee: a time limit saves before Slurm kills, and --after chains).
def test_time_limit_saves_before_slurm_and_an_array_chained_after_resumes(cluster_run):
    """A 2-minute job saves and exits on its own before its limit (deadline or the
    batch shell's lead-time signal); an array chained --after it resumes from that
    checkpoint with nothing recomputed."""
    spec, run = cluster_run("limit", time_limit="2m", grace="50s")
    first = submit(spec)
    wait_for(lambda: last_step(run, first) >= 3, 150, "training to start")
    second = submit(spec, "--after", str(first), "--array", "1")
    (pending,) = slurm.queue([second])
    assert pending.state == "PENDING"

    wait_until_gone([first], timeout=240)
    (record,) = slurm.show_job(first)
    done = exit_record(run, first)
    assert done is not None, (run / "logs" / f"limit-{first}.out").read_text()
    assert done["exit_code"] in (ExitCode.DEADLINE, ExitCode.SIGNALLED), done
    # Saved and stopped before the limit: a planned stop, COMPLETED, the time limit in the comment.
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), record
    assert record["Comment"].startswith("jobgen: time limit") and f"(exit {done['exit_code']})" in record["Comment"]
    k = done["end_step"]
    assert [p.name for p in complete_checkpoints(run)] == [f"step-{k:08d}"]

    task = running_task(second, 1)
    resumed = wait_for(lambda: first_step_record(run, task), 150, "the chained job's first step")
    assert resumed["start_step"] == k and resumed["resumed_from"] == f"step-{k:08d}"
    stop_run(run, [second])
    view = status(run)
    by_job = {t["job_id"]: t for t in view["tasks"]}
    assert by_job[first]["end_step"] == k and by_job[task]["start_step"] == k
    assert by_job[task]["recomputed_steps"] == 0
    assert view["goodput"] is not None and 0 < view["goodput"] < 1
    limit_end = first_step_record(run, first)["job_start"] + 120
    print(
        f"time limit: exit {done['exit_code']} at step {k}, {limit_end - done['time']:.0f}s before the 2m limit; "
        f"chained job resumed at step {resumed['start_step']}, first step {resumed['seconds_to_first_step']:.1f}s "
        f"after its start, recomputed 0; goodput {view['goodput']:.2f}"
    )


def test_the_run_directorys_script_sbatched_by_hand_as_an_array_goes_on_as_submit_would(cluster_run):
    """The script in the run directory is a user's to read and ``sbatch --array`` by hand: the
    tasks of an array queued so, without jobgen, resume from the run's checkpoint, stop on the
    kill switch one after the other (%1), and are in ``jobgen status`` as submit's are."""
    spec, run = cluster_run("byhand", array=1)
    first = submit(spec)
    wait_for(lambda: last_step(run, first) >= 3, 150, "the submitted task to train")
    stop_run(run, [first])
    saved = exit_record(run, first)["end_step"]
    (run / "switches" / "kill").unlink()

    script = run / "train.sbatch"
    out = subprocess.run(
        ["sbatch", "--parsable", "--array=1-2%1", str(script)], capture_output=True, text=True, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    array = int(out.stdout.strip().split(";")[0])
    task1 = running_task(array, 1, timeout=150)
    resumed = wait_for(lambda: first_step_record(run, task1), 150, "the hand-queued task's first step")
    assert resumed["start_step"] == saved and resumed["resumed_from"] == f"step-{saved:08d}"
    wait_for(lambda: last_step(run, task1) >= saved + 2, 120, "the hand-queued task to train")
    stop_run(run, [array])
    assert exit_record(run, task1)["exit_code"] == ExitCode.KILL_SWITCH
    tasks = {r["ArrayTaskId"]: r for r in array_tasks(array)}
    # Task 2 started after task 1 (%1), saw the switch and left before srun.
    assert tasks["2"]["JobState"] == "COMPLETED" and "kill switch" in tasks["2"]["Comment"], tasks
    view = status(run)
    by_job = {t["job_id"]: t for t in view["tasks"]}
    assert by_job[task1]["start_step"] == saved and by_job[task1]["recomputed_steps"] == 0, view["tasks"]
    assert view["step"] >= saved + 2


@pytest.mark.full
def test_signals_and_requeue_resume_without_lost_steps(cluster_run):
    """scancel --signal=USR1 (what Slurm's --signal and many preemption set-ups send)
    saves and exits; the next array task resumes. A requeue of the running job
    (SIGTERM to every process, as preemption does) saves, and the requeued job resumes."""
    spec, run = cluster_run("preempt", array=2)
    array = submit(spec)
    task1 = running_task(array, 1)
    wait_for(lambda: last_step(run, task1) >= 3, 150, "task 1 to train")
    # Array tasks by ARRAY_TASK: the last task's own job id is the array's id, and a bare
    # array id would signal (or requeue) every task of the array.
    slurm.cancel(f"{array}_1", signal="USR1")
    wait_for(lambda: exit_record(run, task1), 120, "task 1 to exit")
    end1 = exit_record(run, task1)["end_step"]
    assert exit_record(run, task1)["exit_code"] == ExitCode.SIGNALLED
    # It saved where it stopped (no step- or time-based save is due in this run).
    assert [p.name for p in complete_checkpoints(run)] == [f"step-{end1:08d}"]

    task2 = running_task(array, 2)
    assert wait_for(lambda: first_step_record(run, task2), 150, "task 2 to train")["start_step"] == end1
    wait_for(lambda: last_step(run, task2) >= end1 + 3, 120, "task 2 to make progress")
    subprocess.run(["scontrol", "requeue", f"{array}_2"], check=True, capture_output=True)
    wait_for(lambda: exit_record(run, task2, restart=0), 120, "the preempted run to save and exit")
    end2 = exit_record(run, task2, restart=0)["end_step"]
    assert exit_record(run, task2, restart=0)["exit_code"] == ExitCode.SIGNALLED
    again = wait_for(lambda: first_step_record(run, task2, restart=1), 240, "the requeued job to train")
    assert again["start_step"] == end2
    stop_run(run, [array])
    tasks = {(t["job_id"], t["restart"]): t for t in status(run)["tasks"]}
    assert tasks[(task2, 0)]["recomputed_steps"] == 0 and tasks[(task2, 1)]["recomputed_steps"] == 0
    assert tasks[(task2, 1)]["start_step"] == end2


@pytest.fixture()
def teammate():
    """A second user in a shared group, as on a real cluster's project directory."""
    group, user = "jgteam", "jgmate"
    made_group = subprocess.run(["getent", "group", group], capture_output=True).returncode != 0
    if made_group:
        subprocess.run(["groupadd", group], check=True)
    made_user = subprocess.run(["id", user], capture_output=True).returncode != 0
    if made_user:
        subprocess.run(["useradd", "--no-create-home", "--gid", group, "--shell", "/bin/sh", user], check=True)
    root = Path(f"/var/tmp/jobgen-team-{uuid.uuid4().hex[:8]}")
    root.mkdir()
    shutil.chown(root, group=group)
    root.chmod(0o2775)
    yield user, root
    shutil.rmtree(root, ignore_errors=True)
    # Leave the machine's accounts as they were.
    if made_user:
        subprocess.run(["userdel", user], capture_output=True)
    if made_group:
        subprocess.run(["groupdel", group], capture_output=True)


def test_kill_switch_by_a_teammate_stops_a_two_node_job_and_the_queue(cluster_run, tmp_path, teammate):
    user, root = teammate
    spec, run = cluster_run("team", nodes=2, array=3, runs_root=root)
    array = submit(spec)
    task1 = running_task(array, 1)
    wait_for(lambda: last_step(run, task1) >= 3, 180, "task 1 to train")
    code, out = jobgen_as(user, ["stop", str(run)], tmp_path / "stop.out")
    # Visible by now. Not the file's mtime: the kernel stamps it from a coarse clock (up to a
    # few ms behind time.time()), and a step of the tiny model is short enough for that to move
    # it before the line of a step whose switch check had not seen the file yet.
    appeared = time.time()
    assert code == 0, out
    assert pwd.getpwuid((run / "switches" / "kill").stat().st_uid).pw_name == user
    assert grp.getgrgid((run / "switches" / "kill").stat().st_gid).gr_name == "jgteam"
    wait_until_gone([array], timeout=240)
    done = exit_record(run, task1)
    # Within one optimizer step: steps logged before the file appeared, plus the one in flight.
    before = max(r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["time"] <= appeared)
    assert done["exit_code"] == ExitCode.KILL_SWITCH and done["end_step"] - before <= 1, (before, done)
    print(
        f"kill switch: file at step {before}, checkpoint and exit at step {done['end_step']}, "
        f"{done['time'] - appeared:.1f}s after the file appeared"
    )
    assert [p.name for p in complete_checkpoints(run)] == [f"step-{done['end_step']:08d}"]
    tasks = array_tasks(array)
    assert [t["ArrayTaskId"] for t in tasks] == ["1", "2", "3"]
    # A planned stop: Slurm records COMPLETED (no FAIL mail, afterok holds), the reason in the comment.
    assert (tasks[0]["JobState"], tasks[0]["ExitCode"]) == ("COMPLETED", "0:0"), tasks[0]
    assert tasks[0]["Comment"].startswith("jobgen: kill switch") and tasks[0]["Comment"].endswith("(exit 10)")
    for later in tasks[1:]:  # burnt through: left before the rendezvous, launched nothing
        log = (run / "logs" / f"team-{later['JobId']}.out").read_text()
        assert "kill switch" in log and "not starting" in log and "rendezvous" not in log
        assert not (run / "logs" / "ranks" / later["JobId"]).exists()
        assert later["JobState"] == "COMPLETED", later
        assert later["Comment"] == "jobgen: kill switch present: not started (exit 0)", later


def test_save_then_abort_switches(cluster_run):
    spec, run = cluster_run("switches")
    job = submit(spec)
    wait_for(lambda: last_step(run, job) >= 3, 150, "training to start")
    jobgen("save", str(run), check=True)
    saved = wait_for(lambda: complete_checkpoints(run), 60, "the save switch's checkpoint")
    wait_for(lambda: not (run / "switches" / "save").exists(), 30, "the save switch to be removed")
    saved_step = int(saved[0].name.split("-")[1])
    wait_for(lambda: last_step(run, job) >= saved_step + 3, 60, "training to continue after the save")
    jobgen("abort", str(run), check=True)
    wait_until_gone([job], timeout=120)
    done = exit_record(run, job)
    assert done["exit_code"] == ExitCode.ABORTED and done["end_step"] > saved_step
    assert [p.name for p in complete_checkpoints(run)] == [saved[0].name]  # nothing saved on abort
    assert (run / "switches" / "abort").exists()
    (record,) = slurm.show_job(job)
    # Not a planned stop: FAILED with jobgen's code, and why in the comment.
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", f"{int(ExitCode.ABORTED)}:0"), record
    assert record["Comment"].startswith("jobgen: abort switch") and record["Comment"].endswith("(exit 11)"), record


@pytest.mark.full
def test_sigkilled_worker_loses_at_most_the_checkpoint_interval(cluster_run):
    spec, run = cluster_run("crash", array=2, save_every_steps=5, keep_checkpoints=3)
    array = submit(spec)
    task1 = running_task(array, 1)
    wait_for(lambda: last_step(run, task1) >= 12, 180, "task 1 past two checkpoints")
    os.kill(worker_pids(run)[0], signal.SIGKILL)
    task2 = running_task(array, 2)
    resumed = wait_for(lambda: first_step_record(run, task2), 180, "task 2 to train")
    reached = last_step(run, task1)
    assert exit_record(run, task1) is None  # killed: no clean exit
    assert reached - resumed["start_step"] <= 5 and resumed["start_step"] % 5 == 0
    complete_checkpoints(run)
    stop_run(run, [array])
    tasks = {t["job_id"]: t for t in status(run)["tasks"]}
    assert tasks[task2]["recomputed_steps"] == reached - resumed["start_step"]
    print(
        f"SIGKILL: task 1 reached step {reached}, task 2 resumed at {resumed['start_step']}, "
        f"recomputed {reached - resumed['start_step']} (checkpoint every 5)"
    )


@pytest.mark.full
def test_hung_rank_is_ended_by_the_collective_timeout(cluster_run):
    spec, run = cluster_run("hang", array=2, save_every_steps=5, collective_timeout="30s")
    array = submit(spec)
    task1 = running_task(array, 1)
    wait_for(lambda: last_step(run, task1) >= 7, 180, "task 1 to train")
    hung = worker_pids(run)[-1]
    os.kill(hung, signal.SIGSTOP)  # a rank stuck inside a step
    task2 = running_task(array, 2, timeout=240)
    # Task 1 ended on its own, by the collective timeout, not at its 10-minute limit.
    (ended,) = slurm.show_job(task1)
    assert ended["JobState"] not in ("TIMEOUT", "CANCELLED"), ended
    log = (run / "logs" / f"hang-{task1}.out").read_text()
    assert "timed out" in log.lower() or "timeout" in log.lower(), log[-3000:]
    resumed = wait_for(lambda: first_step_record(run, task2), 180, "task 2 to train")
    assert resumed["start_step"] % 5 == 0 and resumed["start_step"] >= 5
    stop_run(run, [array])


@pytest.mark.full
def test_lost_node_job_resumes_on_healthy_nodes(cluster_run, cluster):

    spec, run = cluster_run("nodeloss", nodes=2, save_every_steps=5)
    job = submit(spec)
    wait_for(lambda: last_step(run, job) >= 12, 180, "training past two checkpoints")
    (record,) = slurm.show_job(job)
    nodes = slurm.hostnames(record["NodeList"])
    victim = nodes[-1]
    try:
        kill_node(victim)
        lost_at = time.time()
        reached = last_step(run, job)
        again = wait_for(lambda: first_step_record(run, job, restart=1), 300, "the requeued job to train")
        (requeued,) = slurm.show_job(job)
        assert victim not in slurm.hostnames(requeued["NodeList"])
        assert reached - again["start_step"] <= 5
        stop_run(run, [job])
        print(
            f"node loss: {victim} died at step {reached}; requeued job trained again on {requeued['NodeList']} "
            f"{again['time'] - lost_at:.0f}s later, resumed at {again['start_step']}, "
            f"recomputed {reached - again['start_step']}"
        )
    finally:
        revive_node(cluster, victim)
