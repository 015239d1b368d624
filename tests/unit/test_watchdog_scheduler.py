"""The scheduler's file handling without a cluster: which job files run, log cleaning,
the job file text, and the Slurm client environment inside a job. The chains
themselves run on the dev cluster (test_slurm_watchdog.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from jobgen.slurm import client as slurm
from watchdogs.scheduler import WatchdogHome, clean_logs, interval_name, job_file_text


def test_interval_names_follow_cron():
    assert [interval_name(s) for s in (60, 600, 5400, 3600, 86400, 604800)] == [
        "1m",
        "10m",
        "1h30m",
        "hourly",
        "daily",
        "weekly",
    ]


def test_only_executable_visible_finished_files_run_in_name_order(tmp_path: Path):
    home = WatchdogHome(tmp_path)
    directory = home.cron_dir("1m")
    directory.mkdir()
    for name, mode in [
        ("b.check", 0o755),
        ("a.check", 0o755),
        ("notes.txt", 0o644),
        (".hidden", 0o755),
        ("edit~", 0o755),
        ("x.tmp", 0o755),
    ]:
        (directory / name).write_text("#!/bin/sh\n")
        os.chmod(directory / name, mode)
    assert [p.name for p in home.job_files("1m")] == ["a.check", "b.check"]


def test_old_scheduler_logs_are_cleaned_and_new_ones_kept(tmp_path: Path):
    home = WatchdogHome(tmp_path)
    logs = home.log_dir("1m")
    logs.mkdir(parents=True)
    old, new, queued = logs / "1_0_log.out", logs / "2_0_log.out", logs / "3_submitted.pkl"
    eight_days = time.time() - 8 * 86400
    for path in (old, new, queued):
        path.write_text(path.name)
    for path in (old, queued):
        os.utime(path, (eight_days, eight_days))
    assert clean_logs(home, 7 * 86400, keep_jobs={3}) == 1
    assert not old.exists() and new.exists() and queued.exists()


def test_job_file_quotes_what_it_runs(tmp_path: Path):
    run_dir = tmp_path / "it's a run"
    text = job_file_text("/opt/py thon/bin/python", "watchdogs.disk", run_dir, "r", "1h")
    script = tmp_path / "job"
    script.write_text(text.replace("exec ", "printf '%s\\n' "))
    args = subprocess.run(["sh", str(script)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert args == ["/opt/py thon/bin/python", "-m", "watchdogs.disk", "--run", str(run_dir), "--notify"]


def test_slurm_commands_inside_a_job_do_not_inherit_its_variables(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    monkeypatch.setenv("SBATCH_ACCOUNT", "mine")
    env = slurm.client_env()
    assert "SLURM_JOB_ID" not in env and "SLURM_NTASKS" not in env
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf" and env["SBATCH_ACCOUNT"] == "mine"


def test_named_jobs_parser_reads_squeue_lines():
    text = (
        "17\x1fPENDING\x1f2026-11-21T22:31:21\x1froot\x1f/runs/.watchdogs\n"
        "18\x1fRUNNING\x1f2026-11-21T22:30:20\x1fana\x1f(null)\n"
    )
    jobs = slurm.parse_named_jobs(text)
    assert jobs[0] == slurm.NamedJob(17, "PENDING", "2026-11-21T22:31:21", "root", "/runs/.watchdogs")
    assert jobs[1].comment == ""


def test_a_link_that_is_not_the_recorded_one_ends_without_resubmitting(tmp_path: Path, monkeypatch):
    """A removed chain, a chain replaced by a new install, and the same link run again
    after a requeue all end here; none reaches sbatch (there is no cluster in this test,
    so reaching it would fail loudly)."""
    import dataclasses
    import json

    from watchdogs import scheduler

    home = WatchdogHome(tmp_path)
    (tmp_path / "chains").mkdir()
    monkeypatch.setattr(scheduler, "submit_link", lambda *a: (_ for _ in ()).throw(AssertionError("resubmitted")))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert scheduler.run_link(str(tmp_path), "1m", "tok") == {"ended": True}  # removed: no record

    chain = scheduler.Chain("1m", 60, "tok", None, None, 180, 7 * 86400, job_id=8)
    home.chain_file("1m").write_text(json.dumps(dataclasses.asdict(chain)))
    assert scheduler.run_link(str(tmp_path), "1m", "old-token") == {"ended": True}  # replaced
    assert scheduler.run_link(str(tmp_path), "1m", "tok") == {"ended": True}  # job 7 was requeued; 8 is next
    assert json.loads(home.chain_file("1m").read_text())["job_id"] == 8
