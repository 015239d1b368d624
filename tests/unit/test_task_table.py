"""jobgen.report.task_table: a run's tasks from the queue, the run directory and Slurm's memory.

The scontrol text is captured on the dev cluster; the squeue lines follow a capture there
(tests/unit/test_slurm_parsers.py) with this run's ids and name. The dev cluster has no
accounting, so the sacct lines are written to sacct's documented --parsable2 format. The
run directory records are what the batch script and the trainer write. The dev-cluster test
(tests/cluster/test_slurm_status.py) runs the whole path.
"""

from __future__ import annotations

import time

from jobgen.report.task_table import TIME_LIMIT_KILLED, build_tasks, read_task_records, unexplained_submissions
from jobgen.runs.goodput import task_reports
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm
from run_dirs import batch_end_record

T0 = 1_800_000_000


def make_run(tmp_path, *submissions) -> RunDir:
    run = RunDir(tmp_path / "demo")
    (run.path / "logs").mkdir(parents=True)
    for job_id, array in submissions:
        run.record_job({"job_id": job_id, "array": array})
    return run


def end_record(run: RunDir, job_id, task, code, slurm_exit, reason, *, array=5, restart=0, start=T0, end=T0 + 170):
    batch_end_record(run, job_id, task, code, slurm_exit, reason, array=array, restart=restart, start=start, end=end)


def trainer_records(job_id, task, start_step, end_step, code, reason, *, array=5, start=T0):
    ids = {"job_id": str(job_id), "restart": 0, "array_job_id": str(array), "array_task": str(task), "time": start}
    return [
        {**ids, "event": "first_step", "job_start": start, "start_step": start_step, "seconds_to_first_step": 21.0},
        {**ids, "event": "exit", "job_start": start, "start_step": start_step, "end_step": end_step, "exit_code": code,
         "exit_reason": reason},
    ]  # fmt: skip


LEAD = "time limit (USR1 90 s before the limit): saving and exiting"


def test_every_task_keeps_its_name_steps_and_reason_after_slurm_forgot_it(tmp_path):
    """No queue, no Slurm memory (MinJobAge passed, or the controller restarted): the rows
    come from the run directory, named ARRAYID_TASK, with steps, timings and the reason."""
    run = make_run(tmp_path, (5, 3))
    end_record(run, 6, 1, 12, 0, LEAD)
    end_record(run, 7, 2, 11, 11, "abort switch: exiting without saving", start=T0 + 200, end=T0 + 260)
    end_record(run, 5, 3, 0, 0, "abort switch present: not started", start=T0 + 270, end=T0 + 271)
    records = trainer_records(6, 1, 0, 40, 12, LEAD) + trainer_records(7, 2, 40, 55, 11, "abort", start=T0 + 200)
    reports = task_reports(records, [])
    rows = build_tasks(run, "demo", [], [], reports, read_task_records(run), 180)
    assert [(t.slurm_id, t.state, t.jobgen_exit) for t in rows] == [
        ("5_1", "COMPLETED", 12),
        ("5_2", "FAILED", 11),
        ("5_3", "COMPLETED", 0),
    ]
    first = rows[0]
    assert (first.start_step, first.end_step, first.recomputed_steps, first.seconds_to_first_step) == (0, 40, 0, 21.0)
    assert first.exit_reason == LEAD and first.nodes == "node[1-2]"
    assert (first.start_time, first.elapsed_seconds, first.time_limit_seconds) == (T0, 170, 180)
    assert rows[1].exit_reason == "abort" and rows[2].start_step is None
    # Nothing unexplained: Slurm need not be asked about ended jobs.
    assert unexplained_submissions(run, [], read_task_records(run)) == []


# squeue --noheader --array --format=SQUEUE_FORMAT on the dev cluster: task 2 of array 5 running
# as job 7, task 3 waiting behind it (pending tasks carry the array's id).
QUEUE = """\
5\x1f5\x1f3\x1fPENDING\x1fJobArrayTaskLimit\x1f0:00\x1f3:00\x1f\x1fN/A\x1fdemo
7\x1f5\x1f2\x1fRUNNING\x1fNone\x1f1:10\x1f3:00\x1fnode[1-2]\x1f2026-11-22T14:04:10\x1fdemo
9\x1f9\x1fN/A\x1fRUNNING\x1fNone\x1f0:05\x1f5:00\x1fnode3\x1f2026-11-22T14:05:00\x1fother-run
"""


def test_queued_and_running_tasks_join_the_recorded_ones(tmp_path):
    run = make_run(tmp_path, (5, 3))
    end_record(run, 6, 1, 13, 0, "time limit near (deadline: ...): saving and exiting")
    queue = slurm.parse_squeue(QUEUE)
    records = trainer_records(6, 1, 0, 40, 13, "deadline") + trainer_records(7, 2, 40, 40, 0, "")[:1]
    rows = build_tasks(run, "demo", queue, [], task_reports(records, []), read_task_records(run), 180)
    assert [(t.slurm_id, t.state, t.restart) for t in rows] == [
        ("5_1", "COMPLETED", 0),
        ("5_2", "RUNNING", 0),
        ("5_3", "PENDING", 0),
    ]
    running, pending = rows[1], rows[2]
    assert running.start_step == 40 and running.nodes == "node[1-2]" and running.elapsed_seconds == 70
    assert running.time_limit_seconds == 180 and running.start_time == slurm.parse_time("2026-11-22T14:04:10")
    assert pending.reason == "JobArrayTaskLimit" and pending.nodes is None
    assert unexplained_submissions(run, queue, read_task_records(run)) == []


def test_a_requeued_job_shows_each_attempt(tmp_path):
    """A requeued job keeps its id: the attempt that ended and the one queued again are two rows."""
    run = make_run(tmp_path, (5, 1))
    end_record(run, 5, 1, 12, 0, "SIGTERM (preemption, requeue or scancel): saving and exiting")
    queue = slurm.parse_squeue("5\x1f5\x1f1\x1fPENDING\x1fBeginTime\x1f0:00\x1f3:00\x1f\x1fN/A\x1fdemo\n")
    rows = build_tasks(run, "demo", queue, [], [], read_task_records(run), 180)
    assert [(t.slurm_id, t.restart, t.state) for t in rows] == [("5_1", 0, "COMPLETED"), ("5_1", 1, "PENDING")]


# `scontrol show job --oneliner 4` on the dev cluster (sbatch --array=1-2%1 -t 1 --wrap "sleep 300",
# task 2 cancelled while pending), MinJobAge not yet passed: task 1 killed at its limit (no record of
# its own), task 2 never ran. No Comment= field: Slurm 22.05 prints it only when set.
SCONTROL = (
    "JobId=4 ArrayJobId=4 ArrayTaskId=2 ArrayTaskThrottle=1 JobName=demo UserId=root(0) GroupId=root(0) "
    "MCS_label=N/A Priority=4294901757 Nice=0 Account=(null) QOS=(null) JobState=CANCELLED "
    "Reason=JobArrayTaskLimit Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 "
    "RunTime=00:00:00 TimeLimit=00:01:00 TimeMin=N/A SubmitTime=2026-11-22T14:20:40 EligibleTime=Unknown "
    "AccrueTime=2026-11-22T14:20:41 StartTime=2026-11-22T14:20:45 EndTime=2026-11-22T14:20:45 "
    "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-22T14:20:41 Scheduler=Main "
    "Partition=debug AllocNode:Sid=localhost:7067 ReqNodeList=(null) ExcNodeList=(null) NodeList= "
    "NumNodes=1 NumCPUs=1 NumTasks=N/A CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=4G,node=1,billing=1 "
    "Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) "
    "Command=(null) WorkDir=/tmp StdErr=/tmp/slurm-4_2.out StdIn=/dev/null StdOut=/tmp/slurm-4_2.out "
    "Power=\n"
    "JobId=5 ArrayJobId=4 ArrayTaskId=1 ArrayTaskThrottle=1 JobName=demo UserId=root(0) GroupId=root(0) "
    "MCS_label=N/A Priority=4294901757 Nice=0 Account=(null) QOS=(null) JobState=TIMEOUT Reason=TimeLimit "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:01:01 "
    "TimeLimit=00:01:00 TimeMin=N/A SubmitTime=2026-11-22T14:20:40 EligibleTime=2026-11-22T14:20:41 "
    "AccrueTime=2026-11-22T14:20:41 StartTime=2026-11-22T14:20:41 EndTime=2026-11-22T14:21:42 "
    "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-22T14:20:41 Scheduler=Main "
    "Partition=debug AllocNode:Sid=localhost:7067 ReqNodeList=(null) ExcNodeList=(null) NodeList=node1 "
    "BatchHost=node1 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=1,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 "
    "MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 "
    "Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp StdErr=/tmp/slurm-4_1.out StdIn=/dev/null "
    "StdOut=/tmp/slurm-4_1.out Power=\n"
)


def test_slurm_memory_names_the_ends_that_left_no_record(tmp_path):
    run = make_run(tmp_path, (4, 2))
    assert unexplained_submissions(run, [], {}) == [4]
    ended = [r for r in map(slurm.job_record, slurm.parse_records(SCONTROL)) if r is not None]
    rows = build_tasks(run, "demo", [], ended, [], {}, 60)
    assert [(t.slurm_id, t.job_id, t.state, t.exit_reason) for t in rows] == [
        ("4_1", 5, "TIMEOUT", TIME_LIMIT_KILLED),
        ("4_2", 4, "CANCELLED", "cancelled"),
    ]
    assert rows[0].elapsed_seconds == 61 and rows[0].nodes == "node1" and rows[0].exit_code == "0:15"
    assert rows[0].time_limit_seconds == 60 and rows[1].nodes is None


def test_a_submission_nobody_remembers_is_said_so_but_only_when_slurm_answered(tmp_path):
    run = make_run(tmp_path, (5, 1))
    (row,) = build_tasks(run, "demo", [], [], [], {}, 180)
    assert row.state == "ENDED" and "no record" in row.exit_reason
    assert build_tasks(run, "demo", [], [], [], {}, 180, slurm_answered=False) == []


# sacct --noheader --parsable2 --delimiter=SEP --format=SLURM.SACCT_FIELDS where accounting keeps comments:
# one line per job and one per step.
SACCT = """\
6\x1f5_1\x1fCOMPLETED\x1f0:0\x1f\x1fnode[1-2]\x1f2026-11-22T14:00:02\x1f2026-11-22T14:02:52\x1f3\x1fdemo\x1fjobgen: time limit (USR1 90 s before the limit): saving and exiting (exit 12)
6.batch\x1f6.batch\x1fCOMPLETED\x1f0:0\x1f\x1fnode1\x1f2026-11-22T14:00:02\x1f2026-11-22T14:02:52\x1f\x1fbatch\x1f
6.0\x1f6.0\x1fCOMPLETED\x1f0:0\x1f\x1fnode[1-2]\x1f2026-11-22T14:00:05\x1f2026-11-22T14:02:50\x1f\x1fbash\x1f
5\x1f5_[2-3%1]\x1fPENDING\x1f0:0\x1fJobArrayTaskLimit\x1fNone assigned\x1fUnknown\x1fUnknown\x1f3\x1fdemo\x1f
"""  # noqa: E501


def test_sacct_lines_of_jobs_not_steps():
    (record,) = slurm.parse_sacct(SACCT)
    assert (record.job_id, record.array_job_id, record.array_task, record.state) == (6, 5, "1", "COMPLETED")
    assert record.time_limit == 180 and record.comment.endswith("(exit 12)")
    assert record.end - record.start == 170
    assert slurm.accounting_enabled({"AccountingStorageType": "accounting_storage/slurmdbd"})
    assert not slurm.accounting_enabled({"AccountingStorageType": "accounting_storage/none"})
    assert not slurm.accounting_enabled({})


def test_a_crash_the_batch_script_blamed_on_a_node_keeps_the_scripts_words(tmp_path):
    """The trainer crashed (no exit record: goodput can only guess "killed?"); the batch
    script found the node at fault and recorded it: status says so."""
    run = make_run(tmp_path, (5, 1))
    blamed = "node failure: node2 quarantined (its ranks 2,3 went silent while ranks 0,1 waited out the 20 s ...)"
    end_record(run, 6, 1, 20, 20, blamed)
    records = trainer_records(6, 1, 0, 5, 0, "")[:1]  # first_step only: it crashed
    metrics = [{"job_id": "6", "restart": 0, "step": 5, "time": T0 + 60, "step_seconds": 1.0}]
    reports = task_reports(records, metrics)
    row = build_tasks(run, "demo", [], [], reports, read_task_records(run), 600)[0]
    assert (row.state, row.jobgen_exit, row.exit_reason, row.end_step) == ("FAILED", 20, blamed, 5)


def test_a_run_by_hand_outside_slurm_leaves_no_row_and_breaks_nothing(tmp_path):
    """torchrun by hand (no SLURM_JOB_ID): its records say job "None"; status of the run
    shows the Slurm tasks and nothing for it, instead of failing on the id."""
    run = make_run(tmp_path, (5, 1))
    end_record(run, 6, 1, 12, 0, LEAD)
    by_hand = [
        {**r, "job_id": "None", "array_job_id": None, "array_task": None} for r in trainer_records(0, 0, 40, 45, 0, "")
    ]
    reports = task_reports(trainer_records(6, 1, 0, 40, 12, LEAD) + by_hand, [])
    rows = build_tasks(run, "demo", [], [], reports, read_task_records(run), 180)
    assert [(t.slurm_id, t.state, t.end_step) for t in rows] == [("5_1", "COMPLETED", 40)]


def test_a_task_that_recorded_its_end_and_is_still_running_in_squeue_is_one_row(tmp_path):
    """The batch script writes how the task ended, then sets the comment and exits: for that
    moment squeue still says RUNNING. One row, the recorded end (found on the dev cluster:
    a second '10_1 RUNNING' row beside '10_1 COMPLETED'); a requeued attempt, which starts
    after the recorded end, is still a row of its own."""
    run = make_run(tmp_path, (5, 1))
    end_record(run, 5, 1, 0, 0, "reached step 40 of 40: finished", start=T0, end=T0 + 170)
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + 2))
    still = slurm.parse_squeue(f"5\x1f5\x1f1\x1fRUNNING\x1fNone\x1f2:50\x1f3:00\x1fnode1\x1f{started}\x1fdemo\n")
    rows = build_tasks(run, "demo", still, [], [], read_task_records(run), 180)
    assert [(t.slurm_id, t.restart, t.state) for t in rows] == [("5_1", 0, "COMPLETED")]
    again = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + 300))
    requeued = slurm.parse_squeue(f"5\x1f5\x1f1\x1fRUNNING\x1fNone\x1f0:10\x1f3:00\x1fnode2\x1f{again}\x1fdemo\n")
    rows = build_tasks(run, "demo", requeued, [], [], read_task_records(run), 180)
    assert [(t.slurm_id, t.restart, t.state) for t in rows] == [("5_1", 0, "COMPLETED"), ("5_1", 1, "RUNNING")]


def test_a_task_whose_program_recorded_its_end_before_the_batch_script_is_one_row(tmp_path):
    """The trainer's exit record comes before the batch script's end record: between the two,
    squeue says RUNNING and the batch record has a start but no end (seen on the dev cluster)."""
    run = make_run(tmp_path, (5, 1))
    batch_end_record(run, 5, 1, None, None, "", start=T0, end=None)
    reports = task_reports(trainer_records(5, 1, 0, 40, 0, "reached step 40 of 40: finished", start=T0), [])
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 - 2))
    still = slurm.parse_squeue(f"5\x1f5\x1f1\x1fRUNNING\x1fNone\x1f2:50\x1f3:00\x1fnode1\x1f{started}\x1fdemo\n")
    rows = build_tasks(run, "demo", still, [], reports, read_task_records(run), 180)
    assert [(t.slurm_id, t.restart, t.state) for t in rows] == [("5_1", 0, "COMPLETED")]
