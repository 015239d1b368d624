"""Parsers of Slurm's output, fed text captured from Slurm 22.05 (the dev cluster)."""

import pytest

from jobgen.preflight import _gres_count
from jobgen.slurm import parse_job_id, parse_key_values, parse_records, parse_squeue, parse_version

PARTITIONS = """\
PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=1-00:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=node[1-3] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=12 TotalNodes=3 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED
PartitionName=short AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=00:05:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=node[1-3] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=12 TotalNodes=3 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED
"""

NODE_DOWN = (
    "NodeName=node2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=0.31 AvailableFeatures=(null) "
    "ActiveFeatures=(null) Gres=gpu:h100:8(S:0-1),shard:8 NodeAddr=10.213.47.12 NodeHostName=vm Version=22.05.8 "
    "OS=Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 (2024-02-01) RealMemory=4096 AllocMem=0 "
    "State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Reason=Not responding [root@2026-11-21T19:50:01]"
)


def test_partition_records():
    parts = {p["PartitionName"]: p for p in parse_records(PARTITIONS)}
    assert parts["debug"]["Default"] == "YES" and parts["debug"]["Nodes"] == "node[1-3]"
    assert parts["short"]["MaxTime"] == "00:05:00" and parts["short"]["JobDefaults"] == "(null)"


def test_values_with_spaces_run_until_the_next_key():
    node = parse_key_values(NODE_DOWN)
    assert node["OS"] == "Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 (2024-02-01)"
    assert node["Reason"] == "Not responding [root@2026-11-21T19:50:01]"
    assert node["State"] == "DOWN+NOT_RESPONDING" and node["CPUTot"] == "4"


@pytest.mark.parametrize("gres, name, count", [
    ("gpu:h100:8(S:0-1),shard:8", "gpu", 8),
    ("gpu:h100:8(S:0-1),shard:8", "gpu:h100", 8),
    ("gpu:h100:8(S:0-1)", "gpu:a100", 0),
    ("gpu:4,gpu:rtx4090:2", "gpu", 6),
    ("(null)", "gpu", 0),
    ("", "gpu", 0),
])
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
    text = (
        "41|40|1|RUNNING|None|0:12|5:00|node[1-2]|sft\n"
        "40|40|[2-3%1]|PENDING|JobArrayTaskLimit|0:00|5:00||sft\n"
        "44|44|N/A|PENDING|Dependency|0:00|10:00||name|with|pipes\n"
    )
    rows = parse_squeue(text)
    assert [r.job_id for r in rows] == [41, 40, 44]
    assert rows[0].array_job_id == 40 and rows[0].array_task == "1" and rows[0].state == "RUNNING"
    assert rows[1].array_task == "[2-3%1]" and rows[1].reason == "JobArrayTaskLimit"
    assert rows[2].reason == "Dependency" and rows[2].name == "name|with|pipes"
