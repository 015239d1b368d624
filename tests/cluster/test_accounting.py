"""Slurm accounting on the dev cluster: slurmdbd on the cluster's own MariaDB, so that
``sacct`` answers as on a production cluster, and jobgen reads it.

A job that meets its time limit is TIMEOUT in sacct (in the full suite: Slurm looks at
time limits about once a minute, so it takes 1-2 minutes; the default run sees TIMEOUT in
sacct through tests/cluster/test_slurm_own_script.py).
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import wait_for
from jobgen.devcluster import procs
from jobgen.slurm import client as slurm


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


def test_a_short_job_is_completed_in_sacct(cluster) -> None:
    job_id = _sbatch("-J", "acct-true", "--wrap", "true")
    _wait_sacct(job_id, [job_id, "COMPLETED", "0:0", ""])


def test_a_comment_set_from_inside_the_job_is_in_sacct(cluster) -> None:
    comment = "jobgen: set from inside the job"
    job_id = _sbatch("-J", "acct-comment", "--wrap", f'scontrol update JobId=$SLURM_JOB_ID Comment="{comment}"')
    _wait_sacct(job_id, [job_id, "COMPLETED", "0:0", comment])


def test_jobgen_reads_sacct(cluster) -> None:
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


# In the full suite: the default run sees TIMEOUT in sacct through the unedited script's
# tasks (tests/cluster/test_slurm_own_script.py), and this one waits out a limit on its own.
@pytest.mark.full
def test_a_job_killed_at_its_time_limit_is_timeout_in_sacct(cluster) -> None:
    job_id = _sbatch("-t", "1", "-J", "acct-timeout", "--wrap", "sleep 120")
    _wait_sacct(job_id, [job_id, "TIMEOUT", "0:0", ""], timeout=240)
