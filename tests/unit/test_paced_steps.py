"""tests/paced/sitecustomize.py, which paces the dev cluster's runs that train until stopped: a
rank's training steps start at least PACED_STEP_SECONDS apart, two optimizers stepped in one
training step count once, torch is imported no earlier than the program imports it, and a
process that is not a rank (or has no period) is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import PACED

pytest.importorskip("torch")

PERIOD = 0.3
PROGRAM = """
import json, sys, time
before = "torch" in sys.modules
sleeps = []
real_sleep = time.sleep
time.sleep = lambda s: (sleeps.append(s), real_sleep(s))
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks
model = torch.nn.Linear(4, 4)
first, second = torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)
calls, returns = [], []
for _ in range(4):
    model(torch.randn(2, 4)).sum().backward()
    calls.append(time.monotonic())
    first.step()
    returns.append(time.monotonic())
    second.step()  # the same training step
    first.zero_grad()
print(json.dumps({"torch_before": before, "hooks": len(_global_optimizer_pre_hooks),
                  "calls": calls, "returns": returns, "sleeps": len(sleeps)}))
"""


def run(**env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "PACED_STEP_SECONDS")}
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**full, "PYTHONPATH": str(PACED), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_ranks_steps_start_a_period_apart_and_torch_is_imported_by_the_program():
    out = run(RANK="0", PACED_STEP_SECONDS=str(PERIOD))
    assert out["hooks"] == 1 and not out["torch_before"], out
    # Step k+1's first optimizer returns a period after step k's was called, at the earliest.
    gaps = [later - earlier for earlier, later in zip(out["calls"], out["returns"][1:])]
    assert all(gap >= PERIOD for gap in gaps), gaps
    # Only the first optimizer of a step waits (at most once a step, none before the first).
    assert 1 <= out["sleeps"] <= 3, out


@pytest.mark.parametrize("env", [{"PACED_STEP_SECONDS": str(PERIOD)}, {"RANK": "0"}], ids=["not-a-rank", "no-period"])
def test_a_process_that_is_not_a_paced_rank_is_left_alone(env):
    out = run(**env)
    assert out["hooks"] == 0 and out["sleeps"] == 0, out
