"""What Slurm says of a cluster, as jobgen.sites.inventory types it: records captured from the dev
cluster (Slurm 22.05, `jobgen cluster up --gpus 3,1`), and hand-written lines in Slurm's format
for what the dev cluster does not have (typed and several gres, a node in no partition, a
record that cannot be read)."""

from __future__ import annotations

import pytest

from jobgen.sites.inventory import (
    Inventory,
    InventoryError,
    Node,
    NoSuchPartition,
    Partition,
    gpus_of,
    inventory_from,
    node_from,
    partition_from,
    read_inventory,
)
from jobgen.slurm.client import parse_records

# `scontrol show partition --oneliner` and `scontrol show node --oneliner` on the dev cluster.
PARTITIONS = """\
PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=1-00:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=node[1-2] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=8 TotalNodes=2 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=8,mem=8G,node=2,billing=8,gres/gpu=4
PartitionName=short AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=00:05:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=node[1-2] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=8 TotalNodes=2 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=8,mem=8G,node=2,billing=8,gres/gpu=4
"""  # noqa: E501 - lines as Slurm prints them
NODES = """\
NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=2.60 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:3 NodeAddr=10.213.47.11 NodeHostName=vm Port=17001 Version=22.05.8 OS=Linux 6.18.44-fc-v1272 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4096 AllocMem=0 FreeMem=20154 Sockets=4 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug,short  BootTime=2026-12-05T22:22:13 SlurmdStartTime=2026-12-06T01:41:11 LastBusyTime=2026-12-06T01:41:11 CfgTRES=cpu=4,mem=4G,billing=4,gres/gpu=3 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
NodeName=node2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=2.60 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:1 NodeAddr=10.213.47.12 NodeHostName=vm Port=17002 Version=22.05.8 OS=Linux 6.18.44-fc-v1272 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4096 AllocMem=0 FreeMem=20154 Sockets=4 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug,short  BootTime=2026-12-05T22:22:13 SlurmdStartTime=2026-12-06T01:41:11 LastBusyTime=2026-12-06T01:41:11 CfgTRES=cpu=4,mem=4G,billing=4,gres/gpu=1 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
"""  # noqa: E501 - lines as Slurm prints them


def node_line(
    name: str, *, gres: str = "(null)", partitions: str | None = "gpu", cpus: str = "CPUTot=96", **more
) -> str:
    """A node record in Slurm's format, the fields that matter given (CPUTot as `cpus`: a whole
    `Key=value` or "" for none), the rest as on any node."""
    fields = [
        f"NodeName={name} Arch=x86_64 CoresPerSocket=48 CPUAlloc=0 CPUEfctv={more.pop('efctv', 96)} {cpus}",
        "CPULoad=0.01",
        f"AvailableFeatures={more.pop('features', '(null)')} ActiveFeatures=(null)",
        f"Gres={gres} NodeAddr={name} NodeHostName={name} Version=23.02.7",
        f"OS=Linux 5.14.0 #1 SMP  RealMemory={more.pop('memory', 1031000)} AllocMem=0 FreeMem=1000000",
        "Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A",
        f"Partitions={partitions} " if partitions is not None else "",
        "BootTime=2026-11-01T10:00:00 CfgTRES=cpu=96,mem=1031000M,billing=96",
    ]
    assert not more, more
    return " ".join(f for f in fields if f)


def dev_cluster() -> Inventory:
    return inventory_from(parse_records(PARTITIONS), parse_records(NODES), "22.05.8")


def test_the_dev_clusters_partitions():
    debug, short = dev_cluster().partitions
    assert debug == Partition("debug", default=True, max_time=86400, nodes="node[1-2]", state="UP")
    assert short == Partition("short", default=False, max_time=300, nodes="node[1-2]", state="UP")


def test_the_dev_clusters_nodes():
    node1, node2 = dev_cluster().nodes
    assert node1 == Node("node1", 4, 4096, gpus=3, gpu_type=None, features=(), partitions=("debug", "short"))
    assert node2.gpus == 1 and node2.cpus == node2.usable_cpus == 4 and node2.real_memory_mb == 4096


def test_shapes_of_a_partition_group_its_nodes():
    inventory = dev_cluster()
    assert [n.name for n in inventory.nodes_of("short")] == ["node1", "node2"]
    assert [(s.gpus, s.cpus, s.memory_mb, s.nodes) for s in inventory.shapes("debug")] == [
        (3, 4, 4096, ("node1",)),
        (1, 4, 4096, ("node2",)),
    ]
    uniform = inventory_from([], parse_records("\n".join(node_line(f"gpu{i}", gres="gpu:h100:8") for i in (1, 2))), "")
    assert [(s.gpus, s.cpus, s.memory_mb, s.nodes) for s in uniform.shapes("gpu")] == [
        (8, 96, 1031000, ("gpu1", "gpu2"))
    ]
    assert uniform.shapes("debug") == ()


@pytest.mark.parametrize(
    "gres, gpus, gpu_type",
    [
        ("gpu:3", 3, None),
        ("gpu:h100:8", 8, "h100"),
        ("gpu:h100:8(S:0-1)", 8, "h100"),
        ("gpu:a100:4(S:0-1)", 4, "a100"),
        ("gpu:a100:4(S:0,1)", 4, "a100"),  # a socket list's comma is no gres separator
        ("gpu:h100:4,gpu:a100:2", 6, None),
        ("gpu:h100:4(S:0),gpu:h100:4(S:1)", 8, "h100"),
        ("gpu:4,gpu:rtx4090:2", 6, None),
        ("gpu:h100:8(S:0-1),shard:8", 8, "h100"),
        ("shard:8,mps:400", 0, None),
        ("gpu", 1, None),  # a bare name is one, as in slurm.conf
        ("(null)", 0, None),
        ("", 0, None),
    ],
)
def test_gpus_of_gres(gres, gpus, gpu_type):
    assert gpus_of(gres) == (gpus, gpu_type)


@pytest.mark.parametrize("gres", ["gpu:h100:many", "gpu:h100:8:9", "gpu::8"])
def test_a_malformed_gpu_gres_names_the_node_and_key(gres):
    with pytest.raises(InventoryError, match=r"node 'gpu7': Gres entry"):
        node_from(parse_records(node_line("gpu7", gres=gres))[0])


def test_typed_gres_features_and_reserved_cores():
    record = parse_records(node_line("gpu1", gres="gpu:h100:8(S:0-1)", features="h100,ib", efctv=92))[0]
    node = node_from(record)
    assert (node.gpus, node.gpu_type, node.features) == (8, "h100", ("h100", "ib"))
    assert (node.cpus, node.usable_cpus, node.real_memory_mb) == (96, 92, 1031000)


def test_a_node_in_no_partition_is_kept_and_in_none():
    lines = [node_line("gpu1", gres="gpu:h100:8"), node_line("spare1", partitions=None)]
    inventory = inventory_from(parse_records(PARTITIONS), parse_records("\n".join(lines)), "23.02.7")
    assert [n.name for n in inventory.nodes] == ["gpu1", "spare1"]
    assert inventory.nodes[1].partitions == ()
    assert [n.name for n in inventory.nodes_of("gpu")] == ["gpu1"]


def test_cputot_missing_falls_back_to_cpuefctv():
    node = node_from(parse_records(node_line("gpu1", cpus="", efctv=64))[0])
    assert node.cpus == node.usable_cpus == 64


@pytest.mark.parametrize(
    "line, message",
    [
        (node_line("gpu1", cpus="CPUTot=lots"), r"node 'gpu1': CPUTot='lots' is not a whole number"),
        (node_line("gpu1", memory="4G"), r"node 'gpu1': RealMemory='4G' is not a whole number"),
        (node_line("gpu1", efctv="x"), r"node 'gpu1': CPUEfctv='x' is not a whole number"),
        ("NodeName=gpu1 State=IDLE", r"node 'gpu1': Slurm's record has no CPUTot"),
        ("NodeName=gpu1 CPUTot=4 State=IDLE", r"node 'gpu1': Slurm's record has no RealMemory"),
    ],
)
def test_a_record_that_cannot_be_read_is_an_inventory_error(line, message):
    with pytest.raises(InventoryError, match=message):
        node_from(parse_records(line)[0])


def test_hidden_and_down_partitions_are_kept_with_their_state():
    text = (
        "PartitionName=old Default=NO Hidden=YES MaxTime=UNLIMITED Nodes=(null) State=DOWN\n"
        "PartitionName=gpu Default=NO Hidden=NO MaxTime=2-00:00:00 Nodes=gpu[1-4] State=DRAIN\n"
    )
    old, gpu = (partition_from(r) for r in parse_records(text))
    assert old == Partition("old", default=False, max_time=None, nodes="", state="DOWN", hidden=True)
    assert (gpu.max_time, gpu.state, gpu.hidden) == (2 * 86400, "DRAIN", False)


def test_a_malformed_max_time_names_the_partition():
    with pytest.raises(InventoryError, match=r"partition 'gpu': MaxTime='forever' is not a time limit"):
        partition_from(parse_records("PartitionName=gpu MaxTime=forever State=UP")[0])


def test_partition_choice():
    inventory = dev_cluster()
    assert inventory.choose_partition(None).name == "debug"  # the cluster's default
    assert inventory.choose_partition("short").name == "short"
    with pytest.raises(NoSuchPartition, match=r"no partition 'gpu' on this cluster; its partitions: debug, short"):
        inventory.choose_partition("gpu")


def test_without_a_default_the_only_partition_else_a_list():
    one = Inventory((Partition("gpu", False, None, "gpu1", "UP"),), (), "23.02.7")
    assert one.choose_partition(None).name == "gpu"
    two = Inventory((*one.partitions, Partition("cpu", False, None, "cpu1", "UP")), (), "23.02.7")
    with pytest.raises(NoSuchPartition, match=r"no default partition; choose one with --partition: gpu, cpu"):
        two.choose_partition(None)
    with pytest.raises(NoSuchPartition, match="no partition"):
        Inventory((), (), "23.02.7").choose_partition(None)


def test_read_inventory_asks_the_client(monkeypatch):
    from jobgen.slurm import client

    monkeypatch.setattr(client, "partitions", lambda: parse_records(PARTITIONS))
    monkeypatch.setattr(client, "nodes", lambda: parse_records(NODES))
    monkeypatch.setattr(client, "version", lambda: (22, 5, 8))
    inventory = read_inventory()
    assert inventory.slurm_version == "22.05.8" and len(inventory.nodes) == 2 and len(inventory.partitions) == 2
