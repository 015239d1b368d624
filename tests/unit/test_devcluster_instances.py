"""Several dev clusters on one machine (jobgen.devcluster.instances): each cluster's number, and
the node names, bridge, ports and /etc/hosts block that follow from it, never collide. The
clusters themselves run in tests/cluster/test_devcluster.py, beside the session's."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from jobgen.devcluster import instances, netns
from jobgen.devcluster.config import SLURMCTLD_PORT, SLURMD_BASE_PORT, Layout, render_slurm_conf
from jobgen.devcluster.instances import Instance


@pytest.fixture(autouse=True)
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(instances, "REGISTRY", tmp_path / "registry")
    return tmp_path / "registry"


def test_each_cluster_gets_the_lowest_free_number_and_keeps_it(tmp_path: Path):
    up = {tmp_path / "a", tmp_path / "b"}
    alive = up.__contains__
    assert instances.claim(tmp_path / "a", alive=alive) == Instance(0)
    assert instances.claim(tmp_path / "b", alive=alive) == Instance(1)
    assert instances.claim(tmp_path / "a", alive=alive) == Instance(0)  # its own, again
    assert instances.others(tmp_path / "a") == [tmp_path / "b"]
    instances.release(tmp_path / "a", 0)
    assert instances.claim(tmp_path / "c", alive=alive) == Instance(0)
    assert instances.registered() == [tmp_path / "c", tmp_path / "b"]


def test_a_number_whose_cluster_is_gone_is_free_again(tmp_path: Path):
    assert instances.claim(tmp_path / "dead", alive=lambda d: True) == Instance(0)
    assert instances.claim(tmp_path / "new", alive=lambda d: False) == Instance(0)
    assert instances.registered() == [tmp_path / "new"]


def test_release_leaves_a_number_another_cluster_holds(tmp_path: Path):
    instances.claim(tmp_path / "a", alive=lambda d: True)
    instances.release(tmp_path / "b", 0)
    assert instances.registered() == [tmp_path / "a"]


def test_two_instances_share_no_name_or_port():
    first, second = Instance(0), Instance(1)
    assert first.node_names(3) == ["node1", "node2", "node3"]  # what a single cluster always had
    assert second.node_names(3) == ["node101", "node102", "node103"]
    assert not set(first.node_names(instances.MAX_NODES)) & set(second.node_names(instances.MAX_NODES))
    assert (first.bridge, second.bridge) == ("jgbr0", "jgbr1")
    assert first.port(SLURMCTLD_PORT) == SLURMCTLD_PORT
    ports = [i.port(SLURMCTLD_PORT) for i in (first, second)]
    ports += [i.port(SLURMD_BASE_PORT) + k for i in (first, second) for k in range(3)]
    assert len(ports) == len(set(ports))


def test_each_cluster_has_its_own_block_in_etc_hosts(tmp_path: Path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\tlocalhost\n")
    netns.add_hosts({"node1": "10.0.0.11"}, Instance(0).hosts_marker, hosts)
    netns.add_hosts({"node101": "10.0.1.11"}, Instance(1).hosts_marker, hosts)
    netns.remove_hosts(Instance(0).hosts_marker, hosts)
    text = hosts.read_text()
    assert "node1\n" not in text and "10.0.1.11\tnode101" in text and "localhost" in text


def test_slurm_conf_names_the_instances_ports_and_nodes(tmp_path: Path):
    names = Instance(1).node_names(2)
    text = render_slurm_conf(
        layout=Layout(tmp_path),
        hostname="host",
        controller_addr="10.0.1.1",
        node_addrs={n: "127.0.0.1" for n in names},
        cpus_per_node=2,
        mem_per_node_mb=1024,
        slurmdbd_port=16839,
        slurmctld_port=Instance(1).port(SLURMCTLD_PORT),
        slurmd_ports={n: Instance(1).port(SLURMD_BASE_PORT) + i for i, n in enumerate(names)},
    )
    assert f"SlurmctldPort={SLURMCTLD_PORT + 20}" in text
    assert f"NodeName=node101 NodeHostname=host NodeAddr=127.0.0.1 Port={SLURMD_BASE_PORT + 20} " in text
    assert "PartitionName=debug Nodes=node101,node102 " in text


def test_in_netns_mode_each_node_is_its_own_host(tmp_path: Path):
    """Slurm 24.11 forwards to one node per NodeHostname: nodes on their own network are named
    as their own hosts."""
    text = render_slurm_conf(
        layout=Layout(tmp_path),
        hostname="host",
        controller_addr="10.0.0.1",
        node_addrs={"node1": "10.0.0.11", "node2": "10.0.0.12"},
        cpus_per_node=2,
        mem_per_node_mb=1024,
        slurmdbd_port=16839,
        own_hosts=True,
    )
    assert "NodeName=node1 NodeHostname=node1 NodeAddr=10.0.0.11 " in text
    assert "NodeName=node2 NodeHostname=node2 NodeAddr=10.0.0.12 " in text
    assert "SlurmctldHost=host(10.0.0.1)" in text


def test_fake_gpus_are_gres_with_a_device_file_each(tmp_path: Path):
    """`cluster up --gpus 3,0,1`: GRES gpu on the nodes that have GPUs, gres.conf naming one
    character device per GPU (slurmd reads its numbers); a cluster without GPUs has none of it."""
    from jobgen.devcluster.config import make_gpu_files, render_gres_conf
    from jobgen.devcluster.lifecycle import gpu_counts
    from jobgen.devcluster.state import ClusterError

    names = Instance(0).node_names(3)
    gpus = dict(zip(names, gpu_counts([3, 0, 1], 3)))
    layout = Layout(tmp_path)

    def conf(gpus: dict[str, int]) -> str:
        return render_slurm_conf(
            layout=layout,
            hostname="host",
            controller_addr="10.0.0.1",
            node_addrs={n: "127.0.0.1" for n in names},
            cpus_per_node=4,
            mem_per_node_mb=1024,
            slurmdbd_port=16839,
            gpus=gpus,
        )

    text = conf(gpus)
    assert "GresTypes=gpu" in text and "AccountingStorageTRES=gres/gpu" in text
    assert "RealMemory=1024 Gres=gpu:3 State" in text and "RealMemory=1024 Gres=gpu:1 State" in text
    assert text.count("Gres=gpu") == 2  # node2 has none
    assert "Gres" not in conf({}) and "GresTypes" not in conf({n: 0 for n in names})
    assert render_gres_conf(layout, gpus).splitlines()[1:] == [
        "AutoDetect=off",
        f"NodeName=node1 Name=gpu File={tmp_path}/gpus/node1/nvidia[0-2]",
        f"NodeName=node3 Name=gpu File={tmp_path}/gpus/node3/nvidia0",
    ]
    if os.geteuid() == 0:  # mknod of a character device needs root, as `cluster up` has
        make_gpu_files(layout, gpus)
        files = sorted(p.name for p in (tmp_path / "gpus" / "node1").iterdir())
        assert files == ["nvidia0", "nvidia1", "nvidia2"]
        assert stat.S_ISCHR((tmp_path / "gpus" / "node3" / "nvidia0").stat().st_mode)
    assert gpu_counts([2], 3) == [2, 2, 2] and gpu_counts(None, 2) == [0, 0]
    for bad in ([1, 2], [-1]):
        with pytest.raises(ClusterError, match="--gpus"):
            gpu_counts(bad, 3)
