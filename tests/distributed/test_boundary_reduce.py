"""The step's one all-reduce (trainer.distributed.reduce_sum_and_max) on 3 gloo processes of this
machine: the loss is summed as before and each boundary view is the maximum any rank holds, the
stop action of one rank alone reaching every rank; a value outside its bound is refused before
any rank is waited for.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import REPO, VENV_BIN

pytestmark = pytest.mark.torch

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from trainer.distributed import DistEnv, reduce_sum_and_max
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    env = DistEnv(rank=rank, world_size=3, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    # rank 1 alone asks to stop (5 of 0..6); rank 2 alone sees a save due; nobody an evaluation
    views = [(5 if rank == 1 else 0, 6), (1 if rank == 2 else 0, 1), (0, 1)]
    sums, maxes = reduce_sum_and_max(env, [0.5 + rank, 10.0 * rank], views)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
        json.dump({"sums": sums, "maxes": maxes}, fh)
    dist.destroy_process_group()
    """
)


def test_sums_and_maxima_over_three_ranks_in_one_all_reduce(tmp_path: Path):
    script = tmp_path / "reduce.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=3", str(script), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for result in results:
        assert result["sums"] == [0.5 + 1.5 + 2.5, 30.0]
        assert result["maxes"] == [5, 1, 0]


def test_a_value_outside_its_bound_is_refused_before_any_collective():
    from trainer.distributed import reduce_sum_and_max

    with pytest.raises(ValueError, match=r"7 is outside 0\.\.6"):
        reduce_sum_and_max(None, [1.0], [(7, 6)])  # no process group: refused before it is needed
