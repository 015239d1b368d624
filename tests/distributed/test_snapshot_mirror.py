"""Memory snapshots mirrored to the next node (issue 35, trainer.checkpoints.snapshot_peers):
two ranks on two "nodes" take one; a relaunch with one rank on a node that never held a file
(a spare that replaced a lost node) gets that rank's snapshot from the copy the other node
kept, and both ranks restore exactly what they saved. Through a whole relaunch on the dev
cluster: tests/cluster/test_slurm_in_job_restarts.py (the spare node)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from helpers import REPO, VENV_BIN

pytestmark = pytest.mark.torch

SCRIPT = REPO / "tests" / "scripts" / "snapshot_mirror.py"


def phase(name: str, nodes: str, attempt, out) -> list[dict]:
    out.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "NODES": nodes,
        "JOBGEN_SNAPSHOT_DIR": str(attempt),
    }
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(SCRIPT), name, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


def test_a_rank_on_a_spare_node_restores_from_the_copy_its_old_node_mirrored(tmp_path):
    (tmp_path / "shm").mkdir()  # the tmpfs
    attempt = tmp_path / "shm" / f"jobgen-{os.getuid()}" / "run" / "42.0"
    taken = phase("take", "node1,node2", attempt, tmp_path / "taken")
    # Each node holds its own rank's snapshot and the other's copy.
    for node in ("node1", "node2"):
        assert sorted(p.name for p in (attempt / node).iterdir()) == [
            "step-00000002.rank00000.pt",
            "step-00000002.rank00001.pt",
        ]
    shutil.rmtree(attempt / "node2")  # node2 is lost, with its tmpfs

    back = phase("restore", "node1,node3", attempt, tmp_path / "back")
    assert back == taken  # every weight and Adam moment, rank by rank
    assert all(r["resumed_from"] == 2 and r["exp_avg"] for r in back)

    # Without the copy (node1's of rank 1 gone too), no step is whole: nothing is restored.
    (attempt / "node1" / "step-00000002.rank00001.pt").unlink()
    shutil.rmtree(attempt / "node3", ignore_errors=True)
    missing = phase("restore", "node1,node3", attempt, tmp_path / "missing")
    assert [r["resumed_from"] for r in missing] == [None, None]
