"""Parsers of Slurm's output, fed text captured from Slurm 22.05 (the dev cluster)."""

import pytest

from jobgen.launch.preflight import _gres_count
from jobgen.slurm.client import (
    accounting_enabled,
    parse_job_id,
    parse_key_values,
    parse_records,
    parse_sacct,
    parse_squeue,
    parse_steps,
    parse_time,
    parse_version,
    parse_words,
)

PARTITIONS = """\
PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=1-00:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=node[1-3] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=12 TotalNodes=3 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED
PartitionName=short AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=00:05:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=node[1-3] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=12 TotalNodes=3 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED
"""  # noqa: E501 - lines as Slurm prints them

# `scontrol show node node3 --oneliner` after
# `scontrol update nodename=node3 state=drain reason="disk full on /scratch"`.
NODE_DRAINED = (
    "NodeName=node3 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=1.10 AvailableFeatures=(null) "
    "ActiveFeatures=(null) Gres=(null) NodeAddr=10.213.47.13 NodeHostName=vm Port=17003 Version=22.05.8 "
    "OS=Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4096 AllocMem=0 FreeMem=22833 Sockets=4 Boards=1 "
    "State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug,short  "
    "BootTime=2026-11-21T19:41:18 SlurmdStartTime=2026-11-21T20:00:45 LastBusyTime=2026-11-21T20:00:45 "
    "CfgTRES=cpu=4,mem=4G,billing=4 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s "
    "ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=disk full on /scratch [root@2026-11-21T20:00:47]"
)

# `squeue --noheader --array --format=...` with `sbatch --array=1-3%1` running its first
# task and a job held by --dependency=afterany on it. Pending tasks have no job id of
# their own yet: %A is the array's id for them.
SQUEUE = """\
1\x1f1\x1f2\x1fPENDING\x1fJobArrayTaskLimit\x1f0:00\x1f3:00\x1f\x1fN/A\x1farr
1\x1f1\x1f3\x1fPENDING\x1fJobArrayTaskLimit\x1f0:00\x1f3:00\x1f\x1fN/A\x1farr
2\x1f2\x1fN/A\x1fPENDING\x1fDependency\x1f0:00\x1f3:00\x1f\x1fN/A\x1fdep
3\x1f1\x1f1\x1fRUNNING\x1fNone\x1f0:07\x1f3:00\x1fnode1\x1f2026-11-22T14:20:20\x1farr
"""


def test_partition_records():
    parts = {p["PartitionName"]: p for p in parse_records(PARTITIONS)}
    assert parts["debug"]["Default"] == "YES" and parts["debug"]["Nodes"] == "node[1-3]"
    assert parts["short"]["MaxTime"] == "00:05:00" and parts["short"]["JobDefaults"] == "(null)"


def test_values_with_spaces_run_until_the_next_key():
    node = parse_key_values(NODE_DRAINED)
    assert node["OS"] == "Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0"
    assert node["Reason"] == "disk full on /scratch [root@2026-11-21T20:00:47]"
    assert node["State"] == "IDLE+DRAIN" and node["CPUTot"] == "4" and node["Gres"] == "(null)"
    assert node["CfgTRES"] == "cpu=4,mem=4G,billing=4" and node["AllocTRES"] == ""


@pytest.mark.parametrize(
    "gres, name, count",
    [
        ("gpu:h100:8(S:0-1),shard:8", "gpu", 8),
        ("gpu:h100:8(S:0-1),shard:8", "gpu:h100", 8),
        ("gpu:h100:8(S:0-1)", "gpu:a100", 0),
        ("gpu:4,gpu:rtx4090:2", "gpu", 6),
        ("(null)", "gpu", 0),
        ("", "gpu", 0),
    ],
)
def test_gres_count(gres, name, count):
    assert _gres_count(gres, name) == count


def test_versions():
    assert parse_version("slurm-wlm 22.05.8\n") == (22, 5, 8)
    assert parse_version("slurm 23.11.1") == (23, 11, 1)
    with pytest.raises(ValueError):
        parse_version("no version here")


def test_job_ids():
    assert parse_job_id("123\n") == 123
    assert parse_job_id("456;cluster\n") == 456
    with pytest.raises(ValueError):
        parse_job_id("sbatch: error: Batch job submission failed")


def test_squeue_array_lines():
    rows = parse_squeue(SQUEUE)
    assert [(r.job_id, r.array_job_id, r.array_task, r.state) for r in rows] == [
        (1, 1, "2", "PENDING"),
        (1, 1, "3", "PENDING"),
        (2, 2, "N/A", "PENDING"),
        (3, 1, "1", "RUNNING"),
    ]
    assert rows[0].reason == "JobArrayTaskLimit" and rows[2].reason == "Dependency"
    assert rows[3].nodes == "node1" and rows[3].time_limit == "3:00" and rows[3].elapsed == "0:07"
    # A pending job's start is no start (squeue prints N/A, or the scheduler's estimate).
    assert rows[0].start is None and rows[3].start == parse_time("2026-11-22T14:20:20")


def test_squeue_names_may_contain_the_separator():
    (row,) = parse_squeue("44\x1f44\x1fN/A\x1fPENDING\x1fDependency\x1f0:00\x1f10:00\x1f\x1fN/A\x1fname|with|pipes\n")
    assert row.name == "name|with|pipes"


# `sacct --noheader --parsable2 --delimiter=SEP --duplicates --jobs=1,2,3,4,7,8 --format=SACCT_FIELDS` on the
# dev cluster (slurmdbd 22.05.8, AccountingStoreFlags=job_comment): a job that set its comment
# (with the separator in it) and exited 3; an array `--array=1-3%1` whose tasks set theirs (the
# last task's `scontrol update JobId=$SLURM_JOB_ID` named the whole array, failed on the ended
# tasks and made the task FAILED); a cancelled job; a held job without --time; a job requeued
# while running (one line per start); a job killed by its 1-minute limit.
SACCT_CAPTURED = """\
1\x1f1\x1fFAILED\x1f3:0\x1fNone\x1fnode1\x1f2026-11-25T11:03:44\x1f2026-11-25T11:03:44\x1f1440\x1fprobe-c\x1fhello|there x
1.batch\x1f1.batch\x1fFAILED\x1f3:0\x1f\x1fnode1\x1f2026-11-25T11:03:44\x1f2026-11-25T11:03:44\x1f\x1fbatch\x1f
3\x1f3\x1fCANCELLED by 0\x1f0:0\x1fNone\x1fnode1\x1f2026-11-25T11:03:58\x1f2026-11-25T11:04:00\x1f3\x1fcap-cancel\x1f
3.batch\x1f3.batch\x1fCANCELLED\x1f0:15\x1f\x1fnode1\x1f2026-11-25T11:03:58\x1f2026-11-25T11:04:00\x1f\x1fbatch\x1f
4\x1f4\x1fPENDING\x1f0:0\x1fJobHeldUser\x1fNone assigned\x1fUnknown\x1fUnknown\x1fPartition_Limit\x1fcap-held\x1f
5\x1f2_1\x1fCOMPLETED\x1f0:0\x1fNone\x1fnode1\x1f2026-11-25T11:03:58\x1f2026-11-25T11:03:59\x1f2\x1fcap-arr\x1fjobgen: task 1|done
5.batch\x1f2_1.batch\x1fCOMPLETED\x1f0:0\x1f\x1fnode1\x1f2026-11-25T11:03:58\x1f2026-11-25T11:03:59\x1f\x1fbatch\x1f
6\x1f2_2\x1fCOMPLETED\x1f0:0\x1fJobArrayTaskLimit\x1fnode1\x1f2026-11-25T11:03:59\x1f2026-11-25T11:04:00\x1f2\x1fcap-arr\x1fjobgen: task 2|done
6.batch\x1f2_2.batch\x1fCOMPLETED\x1f0:0\x1f\x1fnode1\x1f2026-11-25T11:03:59\x1f2026-11-25T11:04:00\x1f\x1fbatch\x1f
2\x1f2_3\x1fFAILED\x1f1:0\x1fJobArrayTaskLimit\x1fnode1\x1f2026-11-25T11:04:03\x1f2026-11-25T11:04:04\x1f2\x1fcap-arr\x1fjobgen: task 3|done
2.batch\x1f2_3.batch\x1fFAILED\x1f1:0\x1f\x1fnode1\x1f2026-11-25T11:04:03\x1f2026-11-25T11:04:04\x1f\x1fbatch\x1f
7\x1f7\x1fREQUEUED\x1f0:0\x1fNone\x1fnode1\x1f2026-11-25T11:04:04\x1f2026-11-25T11:04:05\x1f2\x1fcap-requeue\x1f
7.batch\x1f7.batch\x1fCANCELLED\x1f0:15\x1f\x1fnode1\x1f2026-11-25T11:04:04\x1f2026-11-25T11:04:05\x1f\x1fbatch\x1f
8\x1f8\x1fTIMEOUT\x1f0:0\x1fNone\x1fnode1\x1f2026-11-25T11:04:06\x1f2026-11-25T11:05:10\x1f1\x1fcap-timeout\x1f
8.batch\x1f8.batch\x1fCANCELLED\x1f0:15\x1f\x1fnode1\x1f2026-11-25T11:04:06\x1f2026-11-25T11:05:10\x1f\x1fbatch\x1f
7\x1f7\x1fPENDING\x1f0:0\x1fBeginTime\x1fNone assigned\x1fUnknown\x1fUnknown\x1f2\x1fcap-requeue\x1f
"""  # noqa: E501 - lines as Slurm prints them


def test_a_recycled_job_id_is_no_earlier_start_of_the_job():
    """Ids are unique for one controller's lifetime: with --duplicates, sacct also returns the
    job an earlier lifetime ran under the same id (another name), which is no requeue of this one."""
    text = (
        "51\x1f51\x1fCOMPLETED\x1f0:0\x1fNone\x1fnode1\x1f2026-11-20T01:16:38\x1f2026-11-20T01:16:39\x1f60\x1fallocation\x1f\n"
        "51\x1f51\x1fREQUEUED\x1f0:0\x1fNone\x1fnode1\x1f2026-11-28T01:16:38\x1f2026-11-28T01:16:40\x1f1440\x1fr0\x1f\n"
        "51\x1f51\x1fCOMPLETED\x1f0:0\x1fNone\x1fnode1\x1f2026-11-28T01:18:38\x1f2026-11-28T01:19:40\x1f1440\x1fr0\x1f\n"
    )
    assert [(r.name, r.restarts) for r in parse_sacct(text)] == [("allocation", 0), ("r0", 0), ("r0", 1)]


# Captured on the dev cluster (Slurm 22.05): a 3-node --no-kill array task that lost node3,
# resized, went on and ended; task 2 started after it.
SACCT_RESIZED = """\
2\x1f1_1\x1fRESIZING\x1f0:0\x1fNone\x1fnode[1-3]\x1f2026-12-01T20:52:53\x1f2026-12-01T20:53:19\x1f3\x1fnk4.sh\x1f
2.batch\x1f1_1.batch\x1fRESIZING\x1f0:0\x1f\x1fnode1\x1f2026-12-01T20:52:53\x1f2026-12-01T20:53:19\x1f\x1fbatch\x1f
2.0\x1f1_1.0\x1fRESIZING\x1f0:0\x1f\x1fnode[1-3]\x1f2026-12-01T20:52:53\x1f2026-12-01T20:53:19\x1f\x1fbash\x1f
1\x1f1_2\x1fRUNNING\x1f0:0\x1fJobArrayTaskLimit\x1fnode[1-3]\x1f2026-12-01T20:53:35\x1fUnknown\x1f3\x1fnk4.sh\x1f
1.batch\x1f1_2.batch\x1fRUNNING\x1f0:0\x1f\x1fnode1\x1f2026-12-01T20:53:35\x1fUnknown\x1f\x1fbatch\x1f
2\x1f1_1\x1fCOMPLETED\x1f0:0\x1fNone\x1fnode[1-2]\x1f2026-12-01T20:53:19\x1f2026-12-01T20:53:19\x1f3\x1fnk4.sh\x1f
2.1\x1f1_1.1\x1fCOMPLETED\x1f0:0\x1f\x1fnode[1-2]\x1f2026-12-01T20:53:19\x1f2026-12-01T20:53:19\x1f\x1fhostname\x1f
"""


def test_a_job_resized_by_a_lost_node_is_one_start_from_its_first_line():
    """--no-kill (job.spare_nodes): the resize is no requeue; status showed the task twice."""
    records = parse_sacct(SACCT_RESIZED)
    rows = [(r.job_id, r.array_task, r.state, r.nodes, r.restarts) for r in records]
    assert rows == [(1, "2", "RUNNING", "node[1-3]", 0), (2, "1", "COMPLETED", "node[1-2]", 0)]
    (task1,) = [r for r in records if r.job_id == 2]
    assert task1.end - task1.start == 26  # from the job's start, not the resize


def test_sacct_as_slurmdbd_prints_it():
    records = parse_sacct(SACCT_CAPTURED)
    rows = [(r.job_id, r.array_job_id, r.array_task, r.state, r.exit_code, r.restarts) for r in records]
    assert rows == [
        (1, 1, "N/A", "FAILED", "3:0", 0),
        (3, 3, "N/A", "CANCELLED", "0:0", 0),
        (4, 4, "N/A", "PENDING", "0:0", 0),
        (5, 2, "1", "COMPLETED", "0:0", 0),
        (6, 2, "2", "COMPLETED", "0:0", 0),
        (2, 2, "3", "FAILED", "1:0", 0),
        (7, 7, "N/A", "REQUEUED", "0:0", 0),
        (8, 8, "N/A", "TIMEOUT", "0:0", 0),
        (7, 7, "N/A", "PENDING", "0:0", 1),
    ]
    by_id = {r.job_id: r for r in records}
    assert by_id[1].comment == "hello|there x" and by_id[1].name == "probe-c"
    assert [by_id[j].comment for j in (5, 6, 2)] == [f"jobgen: task {k}|done" for k in (1, 2, 3)]
    assert by_id[8].time_limit == 60 and by_id[8].end - by_id[8].start == 64
    assert by_id[1].time_limit == 1440 * 60 and by_id[8].nodes == "node1"
    # A job that asked for no time limit, never started: nothing to read, nothing to fail on.
    assert (by_id[4].time_limit, by_id[4].start, by_id[4].end, by_id[4].reason) == (None, None, None, "JobHeldUser")


def test_accounting_is_on_where_slurmdbd_stores_it():
    assert accounting_enabled({"AccountingStorageType": "accounting_storage/slurmdbd"})
    assert not accounting_enabled({"AccountingStorageType": "accounting_storage/none"})
    assert not accounting_enabled({})


# `scontrol show job --oneliner` of a running job with GPUs (trimmed): 22.05 (Debian bookworm's)
# names what the job holds TRES; 24.11 (the dev cluster's --slurm 24.11) ReqTRES and AllocTRES.
SHOW_JOB_22_05 = (
    "JobId=5 JobName=gpus JobState=RUNNING NodeList=node[1,3] BatchHost=node1 NumNodes=2 NumCPUs=4 "
    "NumTasks=2 CPUs/Task=2 ReqB:S:C:T=0:0:*:* TRES=cpu=4,node=2,billing=4,gres/gpu=4 Socks/Node=* "
    "TresPerNode=gres:gpu:2\n"
)
SHOW_JOB_24_11 = (
    "JobId=35 JobName=wrap JobState=RUNNING NodeList=node1 BatchHost=node1 NumNodes=1 NumCPUs=1 "
    "NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* ReqTRES=cpu=1,mem=4G,node=1,billing=1,gres/gpu=2 "
    "AllocTRES=cpu=1,node=1,billing=1,gres/gpu=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
    "TresPerNode=gres/gpu:2 \n"
)


@pytest.mark.parametrize(
    ("text", "held"),
    [(SHOW_JOB_22_05, "cpu=4,node=2,billing=4,gres/gpu=4"), (SHOW_JOB_24_11, "cpu=1,node=1,billing=1,gres/gpu=2")],
    ids=["22.05", "24.11"],
)
def test_what_a_job_holds_is_read_under_either_releases_name(text, held):
    from jobgen.slurm.client import allocated_tres

    (record,) = parse_records(text)
    assert allocated_tres(record) == held


# `squeue --steps --noheader --format=STEPS_FORMAT` of a running array task (the supervisor's launch
# step and the batch step), and `--array --states=PENDING --format=%i`, on the dev cluster: 22.05
# (Debian bookworm's) and 24.11 (--slurm 24.11) both name a task's steps by the array's id and the
# task's index.
STEPS = {
    "22.05": ("2_1.5\x1fjobgen-launch-1\n2_1.batch\x1fbatch\n", "2_2\n", "2_1.5"),
    "24.11": ("1_1.0\x1fjobgen-launch-1\n1_1.batch\x1fbatch\n", "1_2\n", "1_1.0"),
}


@pytest.mark.parametrize("series", sorted(STEPS))
def test_steps_and_pending_tasks_as_squeue_names_them(series):
    steps, pending, launch = STEPS[series]
    assert parse_steps(steps) == {launch: "jobgen-launch-1", launch.split(".")[0] + ".batch": "batch"}
    assert parse_words(pending) == [pending.strip()]


def test_a_step_name_may_hold_the_separator():
    assert parse_steps("7.0\x1fa|name with\x1fbars\n\n") == {"7.0": "a|name with\x1fbars"}
    assert parse_words("\n  \n") == []
