"""How your own program's ranks leave (jobgen.runtime.launch): a program that returns with its
process group still standing (as a Hugging Face Trainer script does) has it destroyed by the
launcher while the interpreter is whole, so no gloo thread's work is freed during the
interpreter's finalisation (a SIGABRT after a successful run: pytorch/pytorch#179291). Run as the
batch script runs it: the task's plan, then ``torchrun -m jobgen.runtime.launch --plan`` on 2
gloo processes of this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import REPO, VENV_BIN, run_spec
from jobgen.launch.render import render
from jobgen.runs.materialize import materialize
from jobgen.spec.loader import load_run

pytestmark = pytest.mark.torch

# Joins a gloo group, sums across the ranks, and returns without destroying the group; at the
# interpreter's exit (atexit runs after the launcher returned) it writes whether the group still stood.
PROGRAM = textwrap.dedent(
    """
    import atexit, json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.ones(4)
    dist.all_reduce(total)
    out = os.path.join(sys.argv[1], f"exit-rank{rank}.json")

    def at_exit():
        with open(out, "w") as fh:
            json.dump({"sum": total.tolist(), "group_at_exit": dist.is_initialized()}, fh)

    atexit.register(at_exit)
    """
)


def test_a_program_that_leaves_its_process_group_standing_has_it_destroyed_before_the_exit(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    spec_file = run_spec(
        tmp_path,
        "own",
        job={"program": "command", "time": "1h", "runs_root": "runs"},
        command={"script": str(script), "args": [str(tmp_path)]},
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "JOBGEN_RUN_DIR": str(run.path),
        "SLURM_JOB_ID": "5151",
        "SLURM_RESTART_COUNT": "0",
        "JOBGEN_JOB_START": str(time.time()),
    }
    plan = [sys.executable, "-m", "jobgen.launch.command_plan", "--run-dir", str(run.path), "--job", "5151"]
    subprocess.run([*plan, "--restart", "0"], env=env, check=True)
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "jobgen.runtime.launch"]
    cmd += ["--plan", str(run.command_plan("5151", 0))]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"exit-rank{rank}.json").read_text())
        assert seen == {"sum": [2.0] * 4, "group_at_exit": False}, (rank, seen)
