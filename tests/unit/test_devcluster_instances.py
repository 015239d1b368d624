"""Several dev clusters on one machine (jobgen.devcluster.instances): each cluster's number, and
the node names, bridge, ports and /etc/hosts block that follow from it, never collide. The
clusters themselves run in tests/cluster/test_devcluster.py, beside the session's."""

from __future__ import annotations

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
