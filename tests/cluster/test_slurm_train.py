"""The main job through the whole chain on the dev cluster: sbatch → srun → torchrun → trainer.

examples/sft.toml as a user runs it: 2 nodes x 2 processes (each node its own host,
--netns), FSDP2 with packing and held-out evaluation, a 2-task array whose second task
finds the run done.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import (
    assert_cancelled,
    checkpoints,
    eval_losses,
    jobgen,
    losses,
    read_jsonl,
    submitted_job_id,
    summary,
    wait_until_gone,
)
from jobgen.base.paths import EXAMPLES_DIR
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def test_example_sft_trains_to_the_end_on_two_hosts(cluster, tmp_path: Path, tiny_model: Path):
    examples = tmp_path / "examples"
    shutil.copytree(EXAMPLES_DIR, examples, ignore=shutil.ignore_patterns("tiny-model"))
    (examples / "tiny-model").symlink_to(tiny_model)
    env = {"HOME": str(tmp_path)}  # runs under ~/jobgen-runs
    proc = jobgen("submit", str(examples / "sft.toml"), env=env, check=True)
    job_id = submitted_job_id(proc.stdout)
    wait_until_gone([job_id], timeout=420)

    run = tmp_path / "jobgen-runs" / "tiny-sft"
    info = summary(run)
    assert info["exit_code"] == 0 and info["end_step"] == 60 and info["world_size"] == 4
    assert info["parallelism"] == "fsdp" and info["data_stats"]["packing"] is True
    assert json.loads((run / "done").read_text())["step"] == 60
    curve = losses(run)
    assert curve[60] < curve[5] * 0.7, curve
    # [eval]: every 10 steps; each new best is saved, and kept besides the two newest.
    evals = eval_losses(run)
    assert sorted(evals) == [10, 20, 30, 40, 50, 60] and evals[60] < evals[10], evals
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["eval_loss"] == min(evals.values()) and best["step"] == min(evals, key=evals.get)
    kept = checkpoints(run)
    assert kept[-1] == "step-00000060" and best["checkpoint"] in kept and len(kept) <= 3, kept
    samples = read_jsonl(run / "samples.jsonl")
    assert [x["step"] for x in samples] == [10, 20, 30, 40, 50, 60]

    (first,) = [t for t in slurm.show_job(job_id) if t["ArrayTaskId"] == "1"]
    assert (first["JobState"], first["ExitCode"]) == ("COMPLETED", "0:0"), first
    # Task 2 was cancelled in the queue as task 1 finished the run (issue 47): it never took the nodes.
    assert_cancelled(job_id, ["2"], "the run finished in task ")
    status = json.loads(jobgen("status", str(run), "--json", env=env, check=True).stdout)
    assert status["state"] == "finished" and status["step"] == 60
