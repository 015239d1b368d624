"""The Checkpointer deletes surplus checkpoints off the save's blocking path, and finishes
the deletion at exit (close), in a real one-process gloo world."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.torch

# The deletion is held until the test says the save has returned: a prune on the blocking
# path would wait the whole timeout (and record that it saw no signal) before save() returned.
# argv: the checkpoint root, a free port.
PRELUDE = r"""
import os, sys
from pathlib import Path
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
"""
SCRIPT = (
    PRELUDE
    + r"""
import json, shutil, threading
import torch
from trainer.checkpoints import checkpointer as checkpoint
from trainer.distributed import init_distributed, shutdown

root = Path(sys.argv[1])
returned = threading.Event()
seen = []
real_rmtree = shutil.rmtree

def held_rmtree(path, *args, **kwargs):
    if Path(path).name.startswith(".tmp-deleting-"):
        seen.append((Path(path).name, returned.wait(timeout=20)))
    real_rmtree(path, *args, **kwargs)

env = init_distributed(60, 1)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
ckpt = checkpoint.Checkpointer(root, env, keep=1, every_steps=0, every_seconds=0)
ckpt.save(1, model, optimizer, {"step": 1})
checkpoint.shutil.rmtree = held_rmtree
ckpt.save(2, model, optimizer, {"step": 2})
returned.set()
ckpt.close()
shutdown()
print(json.dumps({"seen": seen, "left": sorted(p.name for p in root.iterdir())}))
"""
)


def run_world_of_one(script: str, root: Path) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-c", script, str(root), str(port)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_surplus_checkpoints_are_deleted_after_the_save_returns_and_before_close_returns(tmp_path):
    proc = run_world_of_one(SCRIPT, tmp_path / "checkpoints")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["seen"] == [[".tmp-deleting-step-00000001", True]], result
    assert result["left"] == ["latest", "step-00000002"], result


def test_a_deletion_cut_short_is_finished_at_the_next_start(tmp_path):
    """A process killed mid-deletion leaves a .tmp-deleting-* directory (the daemon thread dies
    with it); it is never taken for a checkpoint and the next Checkpointer removes it."""
    from jobgen.runs.rundir import complete_checkpoints_in

    root = tmp_path / "checkpoints"
    (root / ".tmp-deleting-step-00000001").mkdir(parents=True)
    (root / ".tmp-deleting-step-00000001" / "__0_0.distcp").write_bytes(b"half")
    assert complete_checkpoints_in(root) == []
    script = PRELUDE + (
        "from trainer.checkpoints.checkpointer import Checkpointer\n"
        "from trainer.distributed import init_distributed, shutdown\n"
        "Checkpointer(Path(sys.argv[1]), init_distributed(60, 1), keep=1, every_steps=0, every_seconds=0)\n"
        "shutdown()\n"
    )
    proc = run_world_of_one(script, root)
    assert list(root.iterdir()) == []
    assert "a deletion that never completed" in proc.stderr
