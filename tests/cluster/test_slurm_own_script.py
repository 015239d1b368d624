"""A script its user did not write, unedited, through Slurm's time limits on the dev cluster
(``program = "command"``; tests/scripts/run_clm_like.py has the shape of transformers'
run_clm.py and is never edited):

- with ``hf_trainer = true`` on 2 nodes: every time limit saves at the lead-time signal, the
  next task resumes with no step computed twice, every task ends COMPLETED with its reason,
  and the last finishes at max_steps with the final model written once;
- with only ``resume_args`` and placeholders (``stop_signal = "none"``, so Slurm kills it at
  each limit) on 1 node: every task ends TIMEOUT and is shown as such, the next resumes from
  the newest ``checkpoint-N`` and redoes at most save_steps;
- a plain program with neither: ``submit`` warns what it gets, and Slurm's lead-time signal is
  forwarded to it as SIGTERM (the task ends COMPLETED, its reason says so).

The first two run side by side (3 nodes: 2 + 1), then the third.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from helpers import (
    DATA,
    REPO,
    command_spec,
    expand_task_rows,
    jobgen,
    read_jsonl,
    running_task,
    submitted_job_id,
    wait_for,
)
from helpers import status as run_status
from jobgen.base.exit_codes import ExitCode
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

SCRIPT = REPO / "tests" / "scripts" / "run_clm_like.py"
SAVE_STEPS = 40  # paced steps (helpers.PACED_STEP_SECONDS): a hundred or more a 2-minute task


def own_script_spec(tmp_path: Path, name: str, args: list[str], *, nodes: int, array: int, **command: object) -> Path:
    """The unedited script (or ``script=``) with one rank a node."""
    script = command.pop("script", SCRIPT)
    return command_spec(tmp_path, name, script, args, nodes=nodes, procs_per_node=1, array=array, **command)


def trainer_args(tiny_model: Path, save_steps: int) -> list[str]:
    """run_clm's arguments as a user writes them, with jobgen's placeholders for where."""
    return [
        *("--save_total_limit", "2"),
        *("--model_name_or_path", str(tiny_model), "--train_file", str(DATA), "--output_dir", "{checkpoint_dir}"),
        *("--max_steps", "1000000", "--save_steps", str(save_steps), "--per_device_train_batch_size", "2"),
        *("--block_size", "128", "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--seed", "3"),
        *("--disable_tqdm", "true", "--run_name", "task-{task}-of-job-{job_id}"),
    ]


def set_max_steps(run: Path, max_steps: int) -> None:
    """The run's --max_steps from the next task on (the plan of each task is built from
    spec.json): the test's way to end the run in a known task whatever this machine's speed."""
    spec = json.loads((run / "spec.json").read_text())
    args = spec["run"]["command"]["args"]
    args[args.index("--max_steps") + 1] = str(max_steps)
    (run / "spec.json").write_text(json.dumps(spec))


def batch_record(run: Path, array_task: int) -> dict | None:
    """The batch script's record of how an array task ended (logs/task.<job>.<restart>.json)."""
    for path in (run / "logs").glob("task.*.json"):
        record = json.loads(path.read_text())
        if record.get("array_task") == str(array_task) and record.get("exit_code") is not None:
            return record
    return None


def plan_of(run: Path, job_id: str) -> dict:
    return json.loads((run / "logs" / f"command-plan.{job_id}.0.json").read_text())


def resumed_at(run: Path, job_id: str) -> int:
    """The step of the ``checkpoint-N`` a task's plan resumed from (0: none)."""
    checkpoint = plan_of(run, job_id)["checkpoint"]
    return int(Path(checkpoint).name.split("-")[1]) if checkpoint else 0


def hold(job_id: int) -> None:
    """``scontrol hold``: the array's pending tasks wait (the running one goes on). scontrol
    exits 1 for the tasks that have ended ("Job has already finished") yet holds the others:
    what counts is that every pending task is held."""
    subprocess.run(["scontrol", "hold", str(job_id)], capture_output=True, text=True, check=False)
    reasons = subprocess.run(
        ["squeue", "-h", "-j", str(job_id), "-t", "PD", "-o", "%r"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert reasons and all(r == "JobHeldAdmin" for r in reasons), reasons


def release(job_id: int, tasks: int) -> None:
    """Lets the held tasks from 3 on run, each with 5 minutes instead of 2: once --max_steps is
    set a few steps past task 2's end, task 3 finishes whatever the machine's load (on CI's
    shared cores a 2-node Trainer start once took the whole 70 s before the lead-time signal,
    and the run ended in task 4). Tasks 1 and 2 have met their 2-minute limits by then."""
    later = f"{job_id}_[3-{tasks}]"
    subprocess.run(["scontrol", "update", f"JobId={later}", "TimeLimit=5"], capture_output=True, text=True, check=True)
    subprocess.run(["scontrol", "release", str(job_id)], capture_output=True, text=True, check=False)


def steps_logged(run: Path, job_id: str) -> int:
    """The Trainer's logged steps in a task (``--logging_steps 1``: one ``{'loss': ...}`` line a
    step) in rank 0's log of that job."""
    text = "".join(p.read_text() for p in (run / "logs" / "ranks" / job_id).rglob("stdout.log"))
    return len(re.findall(r"\{'loss': ", text))


def ended(job_id: int, tasks: int) -> dict[str, dict[str, str]]:
    """Every task of an array as Slurm's accounting has it: state, exit code and comment. The
    controller sends slurmdbd a task's end a moment after the task ends (and holds pending
    tasks as one ``JOB_[4-5]`` row until each starts, cancelled ones too): wait until all ``tasks`` are there."""

    def rows() -> dict[str, dict[str, str]] | None:
        out = subprocess.run(
            ["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "JobID,State,ExitCode,Comment"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        split = [line.split("|", 3) for line in out.splitlines() if line]
        by_index = expand_task_rows(
            [(r[0].partition("_")[2], {"state": r[1].split()[0], "exit": r[2], "comment": r[3]}) for r in split]
        )
        found = {f"{job_id}_{index}": row for index, row in by_index.items()}
        states = [found.get(f"{job_id}_{i}", {}).get("state") for i in range(1, tasks + 1)]
        done = not {None, "PENDING", "RUNNING"} & set(states)
        return found if done else None

    return wait_for(rows, 60, f"sacct to have the {tasks} tasks of job {job_id}")


def finished_in(run: Path, tasks: int) -> int | None:
    """The array task in which the program exited 0 on its own (the run's end; the tasks after it
    are cancelled in the queue as it ends), or None while none has."""
    for index in range(1, tasks + 1):
        record = batch_record(run, index)
        if record is None:
            return None
        if "exited 0 on its own" in record["reason"] or record["reason"].startswith("finished at step"):
            return index
    return None


def test_an_unedited_trainer_script_through_time_limits(cluster, tmp_path, tiny_model):
    # One task more than the runs need: cancelled in the queue as the run finishes.
    hf_tasks = rs_tasks = 4
    hf_spec = own_script_spec(
        tmp_path, "hf", trainer_args(tiny_model, 100000), nodes=2, array=hf_tasks, hf_trainer=True
    )
    resume = ["--resume_from_checkpoint", "{latest_checkpoint}"]
    rs_spec = own_script_spec(
        tmp_path,
        "rs",
        trainer_args(tiny_model, SAVE_STEPS),
        nodes=1,
        array=rs_tasks,
        resume_args=resume,
        stop_signal="none",
    )
    hf_run, rs_run = tmp_path / "runs" / "hf", tmp_path / "runs" / "rs"
    hf = submitted_job_id(jobgen("submit", str(hf_spec), check=True).stdout)
    rs = submitted_job_id(jobgen("submit", str(rs_spec), check=True).stdout)

    # Tasks 1 and 2 of each meet their limits (--max_steps 1000000). While task 2 runs, the
    # array's next tasks are held; once it has ended, --max_steps is set a little past where it
    # got, then they are released with longer limits: each run ends in task 3 whatever the speed
    # of a task (CI's other workers share the 2 cores: tasks of one run have differed threefold).
    running_task(hf, 2, timeout=300)
    hold(hf)
    running_task(rs, 2, timeout=300)
    hold(rs)
    wait_for(lambda: batch_record(hf_run, 2), 300, "the Trainer's task 2 to meet its limit")
    hf_exits = [r for r in read_jsonl(hf_run / "tasks.jsonl") if r["event"] == "exit"]
    assert [e["exit_code"] for e in hf_exits] == [ExitCode.SIGNALLED] * 2, hf_exits
    assert all(e["exit_reason"].startswith("time limit (USR1 ") for e in hf_exits), hf_exits
    total = hf_exits[-1]["end_step"] + 10
    set_max_steps(hf_run, total)
    release(hf, hf_tasks)
    second_rs = wait_for(lambda: batch_record(rs_run, 2), 300, "the plain script's task 2 to be killed")
    rs_total = resumed_at(rs_run, second_rs["job_id"]) + steps_logged(rs_run, second_rs["job_id"]) + SAVE_STEPS // 2
    set_max_steps(rs_run, rs_total)
    release(rs, rs_tasks)

    hf_end = wait_for(lambda: finished_in(hf_run, hf_tasks), 600, "the Trainer's run to finish")
    rs_end = wait_for(lambda: finished_in(rs_run, rs_tasks), 600, "the plain script's run to finish")
    assert (hf_end, rs_end) == (3, 3), (hf_end, rs_end)
    # Accounting of the tasks that ran (cancelled ones stay one `JOB_[a-b]` row).
    hf_rows, rs_rows = ended(hf, min(hf_end + 1, hf_tasks)), ended(rs, min(rs_end + 1, rs_tasks))

    # hf_trainer: COMPLETED with its reason each time, nothing redone, the final model once.
    exits = [r for r in read_jsonl(hf_run / "tasks.jsonl") if r["event"] == "exit"]
    starts = [r for r in read_jsonl(hf_run / "tasks.jsonl") if r["event"] == "first_step"]
    codes = [e["exit_code"] for e in exits]
    assert len(codes) == hf_end >= 3 and set(codes[:-1]) == {ExitCode.SIGNALLED} and codes[-1] == ExitCode.OK, exits
    assert [s["start_step"] for s in starts] == [0, *(e["end_step"] for e in exits[:-1])], starts
    assert exits[-1]["end_step"] == total
    final = (hf_run / "checkpoints" / "final.txt").read_text().splitlines()
    assert final == [f"final at step {total}"], final
    for index in range(1, min(hf_end + 1, hf_tasks) + 1):
        row = hf_rows[f"{hf}_{index}"]
        if index > hf_end:  # cancelled in the queue as the run finished (issue 47)
            assert row["state"] == "CANCELLED" and "cancelled: the run finished" in row["comment"], hf_rows
            continue
        assert row["state"] == "COMPLETED" and row["comment"].startswith("jobgen: "), (index, row)
        assert index >= hf_end or "time limit (USR1 " in row["comment"], hf_rows
    view = run_status(hf_run)
    assert view["state"] == "finished" and all(not t.get("recomputed_steps") for t in view["tasks"]), view

    # resume_args only: TIMEOUT at each limit, shown as such; at most save_steps redone.
    # The task that finished is the one whose program exited 0 on its own; the ones before met
    # their limits. Slurm calls the finisher TIMEOUT when it ended past its limit (it finished
    # while Slurm was ending it: seen once, 5 s past the 2 minutes), else COMPLETED.
    states = [rs_rows[f"{rs}_{i}"]["state"] for i in range(1, rs_end + 1)]
    assert set(states[:-1]) == {"TIMEOUT"}, rs_rows
    assert states[-1] == "COMPLETED" or (
        states[-1] == "TIMEOUT" and rs_rows[f"{rs}_{rs_end}"]["comment"].startswith("jobgen: finished")
    ), rs_rows
    if rs_end < rs_tasks:
        row = rs_rows[f"{rs}_{rs_end + 1}"]
        assert row["state"] == "CANCELLED" and "cancelled: the run finished" in row["comment"], rs_rows
    rows = {t["slurm_id"]: t for t in run_status(rs_run)["tasks"]}
    reached = 0
    for index in range(1, rs_end + 1):
        assert index == rs_end or rs_rows[f"{rs}_{index}"]["comment"].startswith("jobgen: time limit"), rs_rows
        assert index == rs_end or rows[f"{rs}_{index}"]["state"] == "TIMEOUT", rows
        assert "crashed" not in rows[f"{rs}_{index}"]["exit_reason"], rows
        job_id = batch_record(rs_run, index)["job_id"]
        start = resumed_at(rs_run, job_id)
        assert 0 <= reached - start <= SAVE_STEPS, (index, reached, plan_of(rs_run, job_id))
        reached = start + steps_logged(rs_run, job_id)
    assert reached == rs_total


def test_a_plain_program_gets_the_lead_time_signal_forwarded_and_a_warning(cluster, tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(
        "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.5)\n"
    )  # SIGTERM's default action ends it: a program that knows nothing of jobgen
    spec = own_script_spec(tmp_path, "plain", [], nodes=1, array=1, script=script)
    dry = jobgen("validate", str(spec), check=True)
    assert "warning" in dry.stdout + dry.stderr and "SIGTERM" in dry.stdout + dry.stderr, dry.stdout + dry.stderr
    out = jobgen("submit", str(spec), check=True)
    assert "hf_trainer" in out.stdout + out.stderr, out.stdout + out.stderr
    job = submitted_job_id(out.stdout)
    run = tmp_path / "runs" / "plain"
    wait_for(lambda: "started" in "".join(p.read_text() for p in (run / "logs").rglob("stdout.log")), 120, "start")
    # What Slurm's --signal=B:USR1@50 sends the batch shell 50 s before the limit.
    slurm.cancel(f"{job}_1", signal="USR1", batch_only=True)
    record = wait_for(lambda: batch_record(run, 1), 90, "the task to end")
    assert record["exit_code"] == ExitCode.SIGNALLED, record
    assert "SIGTERM forwarded" in record["reason"], record
    row = ended(job, 1)[f"{job}_1"]
    assert row["state"] == "COMPLETED" and "SIGTERM forwarded" in row["comment"], row
