"""The batch script's hang watch (issue 35, train.hang_timeout), run on this machine as
``jobgen submit --local`` runs it: a rank that stops taking steps is found hung, every rank's
stacks are taken, the launch is killed and relaunched; a hang at the same step in the
relaunch stops the run with the failed marker and one reason. The same watch on the dev
cluster, where Slurm's step is killed: tests/cluster/test_slurm_in_job_restarts.py."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers import PLANTED_CRASHES, REPO, fault_dir, make_run, read_jsonl
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.submit import local_environment
from jobgen.runs.rundir import RunDir

pytestmark = [pytest.mark.torch, pytest.mark.lifecycle]


def test_a_hang_at_the_same_step_in_the_relaunch_stops_the_run(tmp_path, tiny_model):
    site = {"profile": "local", "slurm": {"in_job_restarts": 3}}
    run = make_run(tmp_path, tiny_model, site=site, max_steps=20, hang_timeout="10s")
    plant = fault_dir(tmp_path, PLANTED_CRASHES)
    rd = RunDir(run)
    env = {
        **local_environment(rd.load_spec(), 7171),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": f"{plant}{os.pathsep}{REPO}",
        # The one rank (make_run's world) stops in its 3rd optimizer step, in every launch.
        "HANG_AT": "3",
        "HANG_RANK": "0",
    }
    # What a teammate who can write logs/ plants in each launch's heartbeat directory (issue 45):
    # a FIFO among the ranks' files (the watcher's `cat rank-*` waited on it for good), links at
    # the rank's temporary name and at the watcher's clock file to a file of the user's (written
    # and touched through). The hang is still found, and the file is neither written nor touched.
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    os.utime(victim, (1_000_000_000, 1_000_000_000))
    for launch in (0, 1):
        beats = rd.heartbeats("7171", 0, launch)
        beats.mkdir(parents=True, mode=0o755)
        os.mkfifo(beats / "rank-9")
        for name in (".rank-0.tmp", ".watch"):
            os.symlink(victim, beats / name)
    proc = subprocess.run(
        ["bash", str(rd.script("train"))], env=env, cwd=run, capture_output=True, text=True, timeout=400
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == ExitCode.HUNG, out[-4000:]
    assert victim.read_text() == "mine\n" and victim.stat().st_mtime == 1_000_000_000

    # Both launches took steps 1 and 2, then hung; the first hang was relaunched, the second
    # (the same step) stopped the run.
    lines = read_jsonl(run / "tasks.jsonl")
    starts = [(r.get("launch", 0), r["start_step"]) for r in lines if r["event"] == "first_step"]
    assert starts == [(0, 0), (1, 0)], starts
    assert out.count("no rank has taken a step for") == 2, out[-4000:]
    assert "relaunching the program inside this task (relaunch 1 of at most 3)" in out, out[-4000:]
    assert "not relaunching the program: the run is marked failed" in out, out[-4000:]
    marker = json.loads((run / "failed").read_text())
    assert marker["exit_code"] == ExitCode.HUNG and marker["reason"].startswith("hung twice at step 2: "), marker
    assert "stacks in " in marker["reason"] and marker["fix"], marker
    record = json.loads(rd.task_record("7171", 0).read_text())
    assert record["exit_code"] == ExitCode.HUNG and record["reason"] == marker["reason"], record
    (relaunch,) = record["restarts"]
    assert relaunch["after_exit"] == ExitCode.HUNG and relaunch["reason"].startswith("hung: no rank took"), record

    # Each hang left the rank's stacks, in the planted sleep, named in its reason.
    dumps = sorted(rd.hangs.glob("*-job7171.txt"))
    assert len(dumps) == 2, dumps  # one a hang: at least hang_timeout apart, never the same second
    for dump in dumps:
        text = dump.read_text()
        assert "rank 0 " in text and "hang (sitecustomize.py" in text, text[:4000]
        assert str(dump) in marker["reason"] or str(dump) in relaunch["reason"], (dump, marker, relaunch)
    # Nothing of the killed launches is left running.
    left = subprocess.run(["pgrep", "-f", f"--run-dir {run} "], capture_output=True, text=True).stdout
    assert not left.strip(), left
