"""Slurm accounting on the dev cluster: slurmdbd on the cluster's own MariaDB, so that
``sacct`` answers as on a production cluster, and jobgen reads it.

The job that meets its time limit is submitted when the module starts and checked last:
Slurm looks at time limits about once a minute, so it ends 1-2 minutes later, while the
other tests run.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import wait_for
from jobgen import slurm
from jobgen.devcluster import procs


def _run(*args: str, timeout: float = 60) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _sbatch(*args: str) -> str:
    return _run("sbatch", "--parsable", "-o", "/dev/null", *args).strip().split(";")[0]


def _sacct_row(job_id: str) -> list[str]:
    """``sacct -j ID -X -n -P -o JobID,State,ExitCode,Comment``: the job's fields, or []."""
    out = _run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode,Comment")
    rows = [line.split("|", 3) for line in out.splitlines() if line.strip()]
    return rows[0] if rows else []


def _wait_sacct(job_id: str, expected: list[str], timeout: float = 90) -> None:
    """Until sacct shows ``expected``. Polled, not read once at the end: slurmdbd stores a job
    a moment after it ends, and a job that started and ended within a second can first show
    a record built from its end alone (JobName "allocation"; measured on 22.05.8)."""
    seen: list[list[str]] = [[]]

    def matches() -> bool:
        seen[0] = _sacct_row(job_id)
        return seen[0] == expected

    wait_for(matches, timeout, lambda: f"sacct to show {expected} (last: {seen[0]})", interval=1)


@pytest.fixture(scope="module")
def timeout_job(cluster) -> str:
    """A job killed by its 1-minute limit, submitted before the other tests of the module."""
    return _sbatch("-t", "1", "-J", "acct-timeout", "--wrap", "sleep 120")


@pytest.fixture(autouse=True)
def _start_the_slow_job_first(timeout_job: str) -> None:
    """Every test asks for it, so that it is submitted before the first one runs."""


def test_a_short_job_is_completed_in_sacct() -> None:
    job_id = _sbatch("-J", "acct-true", "--wrap", "true")
    _wait_sacct(job_id, [job_id, "COMPLETED", "0:0", ""])


def test_a_comment_set_from_inside_the_job_is_in_sacct() -> None:
    comment = "jobgen: set from inside the job"
    job_id = _sbatch("-J", "acct-comment", "--wrap", f'scontrol update JobId=$SLURM_JOB_ID Comment="{comment}"')
    _wait_sacct(job_id, [job_id, "COMPLETED", "0:0", comment])


def test_jobgen_reads_sacct() -> None:
    """jobgen's own client: accounting is on, and ``ended_jobs`` parses what sacct prints
    for a failed job with a comment (the comment holds sacct's separator)."""
    assert slurm.accounting_enabled(slurm.config())
    job_id = _sbatch("-J", "acct-jobgen", "--wrap", 'scontrol update JobId=$SLURM_JOB_ID Comment="a|b c"; exit 3')
    _wait_sacct(job_id, [job_id, "FAILED", "3:0", "a|b c"])
    (record,) = wait_for(
        lambda: [r for r in slurm.ended_jobs([int(job_id)], accounting=True) if r.name != "allocation"],
        30,
        "sacct to have the job's start record",
    )
    assert (record.job_id, record.array_task, record.name) == (int(job_id), "N/A", "acct-jobgen")
    assert record.state == "FAILED"
    assert record.exit_code == "3:0" and record.comment == "a|b c"
    assert record.start is not None and record.end is not None and record.end >= record.start


def test_accounting_daemons_and_their_files(cluster) -> None:
    """`jobgen cluster status` shows slurmdbd and MariaDB; the password is only in
    slurmdbd.conf (0600, root's, as slurmdbd demands), not in a log, the record or a command line."""
    out = _run(sys.executable, "-m", "jobgen.devcluster.cli", "status")
    assert f"slurmdbd:    {cluster.controller_addr}:{cluster.slurmdbd_port}, pid" in out, out
    assert f"mariadb:     127.0.0.1:{cluster.mariadb_port}, pid" in out, out
    root = Path(cluster.state_dir)
    conf = root / "slurmdbd.conf"
    st = conf.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    (password,) = [line.split("=", 1)[1] for line in conf.read_text().splitlines() if line.startswith("StoragePass=")]
    assert len(password) >= 32
    readable = [root / "state.json", root / "slurm.conf", *(root / "log").iterdir(), root / "mariadb" / "mariadbd.log"]
    assert not [p for p in readable if p.is_file() and password in p.read_text(errors="replace")]
    assert not [pid for pid in procs.all_pids() if password in " ".join(procs.cmdline(pid))]
    assert f"AccountingStorageHost={cluster.controller_addr}" in (root / "slurm.conf").read_text()
    # Registered by slurmctld itself when it first met slurmdbd: `up` runs no sacctmgr.
    listed = _run("sacctmgr", "--noheader", "--parsable2", "list", "cluster", "format=cluster,controlport")
    assert listed.split() == [f"jobgen|{cluster.slurmctld_port}"]


def test_a_job_killed_at_its_time_limit_is_timeout_in_sacct(timeout_job: str) -> None:
    _wait_sacct(timeout_job, [timeout_job, "TIMEOUT", "0:0", ""], timeout=240)
