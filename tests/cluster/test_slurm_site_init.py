"""``jobgen site init`` against the dev cluster: the profile it writes says what the cluster was
started with (``cluster up --nodes 3 --cpus-per-node 4 --gpus 3,1,2``, tests/conftest.py): its
partitions and their time limits, each node's CPUs, memory and GPUs, one node shape per kind of
machine, and SiteProfile accepts it."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from helpers import jobgen
from jobgen.devcluster.config import DEBUG_MAX_TIME, SHORT_MAX_TIME
from jobgen.sites.profile_writer import check_profile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = [pytest.mark.slurm]


def expected_shapes(cluster) -> list[dict[str, object]]:
    """The node shapes of the cluster's record: one per GPU count, in node order."""
    by_gpus: dict[int, list[str]] = {}
    for name in cluster.nodes:
        by_gpus.setdefault(cluster.gpus.get(name, 0), []).append(name)
    return [
        {"nodes": ",".join(names), "gpus": gpus, "cpus": cluster.cpus_per_node, "memory": f"{cluster.mem_per_node_mb}M"}
        for gpus, names in by_gpus.items()
    ]


def test_site_init_describes_the_dev_cluster(cluster):
    result = jobgen("site", "init", "devtest", "--print", check=True)
    text = result.stdout
    check_profile(text)  # TOML, and SiteProfile accepts it
    data = tomllib.loads(text)
    slurm = data["slurm"]
    assert slurm["partition"] == cluster.default_partition
    assert slurm["cpus_per_node"] == cluster.cpus_per_node
    assert slurm["gpus_per_node"] == max(cluster.gpus.values())
    assert slurm["gres_name"] == "gpu" and slurm["mem"] == "0"
    assert slurm["node_shapes"] == expected_shapes(cluster)
    assert f"RealMemory: {cluster.mem_per_node_mb}M" in text
    header = [line for line in text.splitlines() if line.startswith("#   ")]
    for partition, max_time in zip(cluster.partitions, (DEBUG_MAX_TIME, SHORT_MAX_TIME), strict=True):
        assert any(
            partition in h and f"MaxTime {max_time}" in h and f"{len(cluster.nodes)} node(s)" in h for h in header
        )


def test_site_init_writes_the_users_profile_and_keeps_it(cluster, tmp_path: Path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    first = jobgen("site", "init", "devtest", "--partition", "short", "--ifname", "eth0", env=env, check=True)
    path = tmp_path / "jobgen" / "sites" / "devtest.toml"
    assert f"wrote {path}" in first.stdout and "jobgen doctor --site devtest" in first.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = tomllib.loads(path.read_text())
    assert data["slurm"]["partition"] == "short" and data["network"]["ifname"] == "eth0"
    again = jobgen("site", "init", "devtest", env=env)
    assert again.returncode == 1 and "--force" in again.stderr
    assert tomllib.loads(path.read_text())["slurm"]["partition"] == "short"
    jobgen("site", "init", "devtest", "--force", env=env, check=True)
    assert tomllib.loads(path.read_text())["slurm"]["partition"] == cluster.default_partition
