"""Node-local directories: one path, ``<state dir>/node-local``, that every node of the dev
cluster sees as a directory of its own.

On a real cluster each node has directories only it sees (/local/scratch, a venv installed on
the node's own disk) beside the shared filesystem; code that writes a run's files to the one
or expects the other on every node breaks there and nowhere else. The dev cluster's nodes are
slurmd processes on one machine sharing one filesystem, so each slurmd starts in a mount
namespace of its own in which ``<state dir>/node-local`` is a bind mount of that node's
``<state dir>/nodes/<node>/local``; every job step slurmd starts inherits the namespace. A file
a job writes at ``<state dir>/node-local/x`` on node1 is therefore not there on node2, exactly
like node-local scratch, and the host finds it at ``<state dir>/nodes/node1/local/x``. On the
host ``<state dir>/node-local`` is an empty directory, a mountpoint in the nodes' namespaces
only, and never written.

slurmd is started through a chain of execs, so the pid ``up`` records is slurmd's own (and
``slurmd -N node`` is in its command line, which ``down`` checks before signalling it)::

    unshare --mount --propagation slave -- \\
        sh -c 'mount --bind -- "$1" "$2" && shift 2 && exec "$@"' jobgen-node-local \\
        S/nodes/node1/local S/node-local [nsenter --net=/run/netns/jgnode1 --] slurmd -D ... -N node1

``unshare`` without ``--fork`` execs its command, and so do ``sh``'s ``exec`` and ``nsenter``.
Neither util-linux tool bind-mounts by itself; the one alternative without ``sh``, a persistent
namespace (``unshare --mount=FILE``, then ``nsenter --mount=FILE``), needs a bind mount on the
host that a killed ``up`` or ``down`` would leave behind. Here the namespace lives exactly as
long as the node's slurmd and its job steps, nothing is mounted on the host, and ``down``
removes the directories with the rest of the state dir. Propagation ``slave``: what the host
mounts or unmounts later (another cluster's network namespaces in /run/netns) reaches the
nodes, and nothing a node mounts reaches the host.

Needs root and util-linux (``unshare``, ``mount``) on a kernel that allows mount namespaces;
where :func:`available` is False the nodes start as before, without the directory, and
``jobgen cluster status`` says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .config import Layout
from .state import ClusterInfo

# Runs as the bind-mounting step of the chain; $0 names it in `ps` for the moment it runs.
_MOUNT_THEN_EXEC = 'mount --bind -- "$1" "$2" && shift 2 && exec "$@"'
UNAVAILABLE = "not available (needs root and util-linux's unshare and mount)"


def available(search_path: str) -> bool:
    """Whether the nodes can get mount namespaces of their own: root, ``unshare`` and
    ``mount`` on ``search_path``, and a kernel (or container) that lets ``unshare --mount``
    run, which is tried."""
    if os.geteuid() != 0:
        return False
    unshare = shutil.which("unshare", path=search_path)
    if unshare is None or shutil.which("mount", path=search_path) is None:
        return False
    try:
        probe = subprocess.run(
            [unshare, "--mount", "--propagation", "slave", "--", "true"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def wrap(argv: list[str], layout: Layout, node: str) -> list[str]:
    """``argv`` (slurmd's, perhaps behind nsenter) run in a new mount namespace in which
    ``layout.node_local`` is ``node``'s own directory; the process keeps its pid throughout."""
    return [
        "unshare",
        "--mount",
        "--propagation",
        "slave",
        "--",
        "sh",
        "-c",
        _MOUNT_THEN_EXEC,
        "jobgen-node-local",
        str(layout.node_local_source(node)),
        str(layout.node_local),
        *argv,
    ]


def make_dirs(layout: Layout, nodes: list[str]) -> None:
    """The empty mountpoint and each node's own directory, 0755; idempotent (``up`` repairing
    a cluster makes again what someone removed, or its slurmd would not start)."""
    paths = [layout.node_local, layout.nodes_dir]
    for node in nodes:
        paths += [layout.node_local_source(node).parent, layout.node_local_source(node)]
    for path in paths:
        path.mkdir(exist_ok=True)
        path.chmod(0o755)


def set_up(info: ClusterInfo, layout: Layout, search_path: str) -> bool:
    """Make the directories and record them in ``info`` (``node_local``, ``node_local_dirs``)
    when the nodes can have them; False, recording nothing, where they cannot."""
    if not available(search_path):
        return False
    make_dirs(layout, info.nodes)
    info.node_local = str(layout.node_local)
    info.node_local_dirs = {node: str(layout.node_local_source(node)) for node in info.nodes}
    return True


def describe(info: ClusterInfo) -> str:
    """The line ``jobgen cluster status`` prints after ``node-local:``."""
    if not info.node_local:
        return UNAVAILABLE
    on_host = Layout(Path(info.state_dir)).node_local_source("<node>")
    return f"{info.node_local}, each node's own (on the host: {on_host})"
