"""Parsers of Slurm's output, fed text captured from Slurm 22.05 (the dev cluster)."""

import pytest

from jobgen.preflight import _gres_count
from jobgen.slurm import parse_job_id, parse_key_values, parse_records, parse_squeue, parse_time, parse_version

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
1|1|2|PENDING|JobArrayTaskLimit|0:00|3:00||N/A|arr
1|1|3|PENDING|JobArrayTaskLimit|0:00|3:00||N/A|arr
2|2|N/A|PENDING|Dependency|0:00|3:00||N/A|dep
3|1|1|RUNNING|None|0:07|3:00|node1|2026-11-22T14:20:20|arr
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
    (row,) = parse_squeue("44|44|N/A|PENDING|Dependency|0:00|10:00||N/A|name|with|pipes\n")
    assert row.name == "name|with|pipes"
