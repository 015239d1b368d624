"""A program of ten steps that saves every 5 into the checkpoint directory it is given and, in
its first launch inside a task (JOBGEN_LAUNCH 0), crashes at step 7; with ``--resume CKPT`` it
goes on from that checkpoint's step. What tests/distributed/test_command_relaunch.py relaunches.

    python crash_once_loop.py CHECKPOINT_DIR [--resume CHECKPOINT]
"""

import json
import os
import sys
from pathlib import Path

checkpoints = Path(sys.argv[1])
start = 0
if "--resume" in sys.argv:
    start = json.loads((Path(sys.argv[sys.argv.index("--resume") + 1]) / "state.json").read_text())["step"]
launch = int(os.environ.get("JOBGEN_LAUNCH") or 0)
print(f"launch {launch} starts after step {start}", flush=True)
for step in range(start + 1, 11):
    print(f"launch {launch} step {step}", flush=True)
    if step % 5 == 0:
        saving = checkpoints / f".step-{step:05d}"  # a dot: not a checkpoint until the rename
        saving.mkdir(parents=True)
        (saving / "state.json").write_text(json.dumps({"step": step}))
        saving.rename(checkpoints / f"step-{step:05d}")
    if step == 7 and launch == 0:
        raise SystemExit(f"crashing at step {step} in launch {launch}")
print(f"launch {launch} finished", flush=True)
