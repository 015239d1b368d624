"""A batch script queued by an earlier jobgen keeps working after an upgrade (issue 47): Slurm
keeps a script as it was submitted, and an array task queued last week runs it with whatever
jobgen is installed now. The script of commit 3322216 (before the supervisor: relaunch, exit
reading and markers in bash, calling jobgen.runs.quarantine, jobgen.runs.heartbeat and
jobgen.runtime.stacks as entry points) is rendered by that commit's own code, pointed at this
checkout as an upgrade in place would leave it, and run as ``jobgen submit --local`` runs a
script: a planted crash in its first launch is relaunched inside the task, and the relaunch
trains to the end with today's trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from io import BytesIO

import pytest

from helpers import PLANTED_CRASHES, REPO, fault_dir, make_run
from jobgen.launch.submit import local_environment
from jobgen.runs.rundir import RunDir

pytestmark = [pytest.mark.torch, pytest.mark.lifecycle]

OLD = "3322216"  # main before the supervisor (issue 47 was filed against it)


def old_checkout(into):
    """The files of commit OLD that rendering needs, from git (a clone holds every commit)."""
    paths = ["jobgen", "sbatch_templates", "site_configs", "pyproject.toml"]
    archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD, *paths], capture_output=True, check=False)
    if archive.returncode != 0:
        pytest.skip(f"commit {OLD} is not in this clone: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def test_a_script_rendered_before_the_supervisor_runs_to_the_end(tmp_path, tiny_model):
    site = {"profile": "local", "slurm": {"in_job_restarts": 2}}
    run = make_run(tmp_path, tiny_model, site=site, max_steps=8)
    old = old_checkout(tmp_path / "old")
    rendered = subprocess.run(
        [sys.executable, "-m", "jobgen.cli.main", "render", str(tmp_path / "sft.toml")],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(old)}, check=False,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    script = rendered.stdout
    assert "relaunch_refused()" in script and "python -m jobgen.job" not in script  # the old bash
    # jobgen upgraded in place: the old script's checkout is today's.
    script = script.replace(str(old), str(REPO))
    rd = RunDir(run)
    rd.script("train").write_text(script)
    plant = fault_dir(tmp_path, PLANTED_CRASHES)
    env = {
        **local_environment(rd.load_spec(), 7272),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": f"{plant}{os.pathsep}{REPO}",
        "CRASH_AT": "3",  # the first launch crashes in its 3rd step; the relaunch gets past it
        "CRASH_LAUNCH": "0",
    }
    proc = subprocess.run(
        ["bash", str(rd.script("train"))], env=env, cwd=run, capture_output=True, text=True, timeout=400
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "relaunching the program inside this task (relaunch 1 of at most 2)" in out, out[-4000:]
    assert (run / "done").exists(), out[-4000:]
