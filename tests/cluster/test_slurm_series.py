"""A subset of the Slurm scenarios on Slurm 24.11, in CI (docs/slurm-versions.md): the rest of the
suite runs on this machine's 22.05. The scenarios run in a pytest of their own with
``JOBGEN_TEST_SLURM=24.11``, whose ``cluster`` fixture starts a 24.11 dev cluster (built once from
Debian trixie's source: jobgen.devcluster.slurm_builds) beside this session's, with its own state
directory, network and node names, and takes it down after.

The subset: two hosts' doctor (srun, the rendezvous, GRES), the time limit (the lead-time signal,
the saved stop, COMPLETED and the comment, a chained array that resumes), and a killed rank
relaunched inside the task that trains on exactly (the supervisor's squeue, scancel and step reads).
The whole suite on 24.11 is ``JOBGEN_TEST_SLURM=24.11 pytest -m slurm`` (docs/testing.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO, TEST_SLURM_ENV, slurm_series_under_test

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.timeout(1800)]

SERIES = "24.11"
SUBSET = [
    "tests/cluster/test_slurm_submit.py::test_doctor_example_runs_world_size_four_on_two_hosts",
    "tests/cluster/test_slurm_lifecycle.py::test_time_limit_saves_before_slurm_and_an_array_chained_after_resumes",
    "tests/cluster/test_slurm_in_job_restarts.py::test_a_killed_rank_is_relaunched_inside_the_same_task_and_trains_on_exactly",
]


@pytest.mark.skipif(slurm_series_under_test() == SERIES, reason="this session is on 24.11 already")
def test_the_ci_subset_passes_on_slurm_24_11(tmp_path):
    env = {**os.environ, TEST_SLURM_ENV: SERIES}
    for name in ("SLURM_CONF", "JOBGEN_CLUSTER_DIR"):  # this session's cluster's, not the child's
        env.pop(name, None)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rA"]
    argv += [f"--basetemp={tmp_path / 'run'}", "-m", "slurm", *SUBSET]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"{len(SUBSET)} passed" in out and "skipped" not in out.split("short test summary")[-1], out[-3000:]
    print(f"on Slurm {SERIES}: " + out.strip().splitlines()[-1])
