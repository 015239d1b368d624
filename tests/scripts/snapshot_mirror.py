"""Two ranks on two "nodes" (SLURMD_NODENAME from NODES, one name per rank) take memory
snapshots of a small model and its Adam state (phase "take"), or restore the newest one in a
relaunch whose nodes may differ (phase "restore": a rank on a node with no file gets the copy
the other node kept). Each rank writes what it holds to OUT/rank-N.json. Run by
tests/distributed/test_snapshot_mirror.py:

    NODES=node1,node2 torchrun --standalone --nproc-per-node=2 snapshot_mirror.py take OUT
"""

import json
import os
import sys
from pathlib import Path

rank = int(os.environ["RANK"])
os.environ["SLURMD_NODENAME"] = os.environ["NODES"].split(",")[rank]

import torch  # noqa: E402

from trainer.checkpoints.snapshots import Snapshots  # noqa: E402
from trainer.distributed import init_distributed  # noqa: E402

phase, out = sys.argv[1], Path(sys.argv[2])
env = init_distributed(60, 2, use_gpu=False)
torch.manual_seed(rank)  # each rank's own weights: a restore that mixes ranks up shows
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
snapshots = Snapshots.from_environment(env, every_steps=2)
assert snapshots is not None
snapshots.connect(60)


def described(resumed_from: int | None) -> dict:
    state = optimizer.state_dict()["state"]
    return {
        "weight": model.weight.detach().flatten().tolist(),
        "exp_avg": state[0]["exp_avg"].flatten().tolist() if state else None,
        "resumed_from": resumed_from,
    }


if phase == "take":
    for step in (1, 2):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if snapshots.due(step):
            snapshots.take(step, model, optimizer, {"step": step})
    snapshots.close()
    result = described(2)
else:
    step = snapshots.newest_common(None)
    state = snapshots.restore(step, model, optimizer) if step is not None else None
    result = described(state["step"] if state else None)
(out / f"rank-{rank}.json").write_text(json.dumps(result))
torch.distributed.destroy_process_group()
