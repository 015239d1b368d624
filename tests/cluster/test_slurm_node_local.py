"""Each dev-cluster node has a directory only it sees, as a real node has /local/scratch: one path,
``<state dir>/node-local``, that is ``<state dir>/nodes/<node>/local`` on each node
(jobgen.devcluster.nodelocal). The tests of what jobgen makes of a runs_root or a Python
environment that is not on every node rely on it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

# Run on each node of a 2-node step, with the node-local path as $1: it adds the node's name to
# `who` there, waits for the other node to have done the same, and reports what it sees.
# `xargs` puts the listing, and the lines of `who`, on one line each.
REPORT = "; ".join(
    [
        'echo "$SLURMD_NODENAME" >> "$1/who"',
        "sleep 2",
        'echo "$SLURMD_NODENAME|$(ls -A "$1" | xargs)|$(xargs < "$1/who")"',
    ]
)


def _srun_on_two_nodes(script: str, *args: str) -> dict[str, tuple[list[str], list[str]]]:
    """What each node of a 2-node step reported: node -> (its listing, the lines of its `who`)."""
    proc = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "-t", "1", "bash", "-c", script, "report", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),  # the cluster fixture's SLURM_CONF
    )
    assert proc.returncode == 0, f"srun exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    seen: dict[str, tuple[list[str], list[str]]] = {}
    for line in proc.stdout.splitlines():
        assert line.count("|") == 2, f"unexpected output line {line!r}:\n{proc.stdout}"
        node, listing, who = line.split("|")
        seen[node] = (listing.split(), who.split())
    return seen


def test_each_node_sees_only_its_own_node_local_directory(cluster):
    if not cluster.node_local:
        pytest.skip("this dev cluster has no node-local directories (needs root and util-linux's unshare)")
    local = Path(cluster.node_local)
    assert local == Path(cluster.state_dir) / "node-local"
    sources = {node: Path(cluster.node_local_dirs[node]) for node in cluster.nodes}
    assert sources == {node: Path(cluster.state_dir) / "nodes" / node / "local" for node in cluster.nodes}
    for source in sources.values():  # a `who` an earlier run of this test left on a reused cluster
        (source / "who").unlink(missing_ok=True)
    try:
        seen = _srun_on_two_nodes(REPORT, str(local))
        assert len(seen) == 2 and set(seen) <= set(cluster.nodes), seen
        for node, (listing, who) in seen.items():
            # Shared, both nodes' names would be in the one `who` both appended to.
            assert "who" in listing, (node, listing)
            assert who == [node], (node, who)
            assert (sources[node] / "who").read_text() == f"{node}\n"
        for node in set(cluster.nodes) - set(seen):
            assert not (sources[node] / "who").exists(), node
        # The path itself is only a mountpoint in the nodes: never written on the host.
        assert local.is_dir() and list(local.iterdir()) == []
    finally:
        for source in sources.values():
            (source / "who").unlink(missing_ok=True)
