"""Watchdogs without a cluster: settings, the disk check on filesystems the test makes,
the checkpoint forecast, and notifications received by a local SMTP and HTTP server.

Slurm-facing checks (running, hang, memory) and the scheduler chains are tested on
the dev cluster in test_slurm_watchdog.py.
"""

from __future__ import annotations

import email
import email.policy
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers import DATA, REPO, doctor_spec, jobgen, local_receivers, run_spec
from jobgen.base.paths import EXAMPLES_DIR, SITE_CONFIGS_DIR
from jobgen.spec.loader import SpecError, load_run
from jobgen.spec.tables.watchdogs import WatchdogSettings, parse_threshold
from watchdogs.notify import ALERT, REMINDER, RESOLVED, AlertState, decide, deliver
from watchdogs.target import CheckResult, Target

# ---------------------------------------------------------------- settings


def test_thresholds_are_percentages_sizes_or_counts():
    assert parse_threshold("20%") == (20.0, True)
    assert parse_threshold("500G") == (500 * 2**30, False)
    assert parse_threshold("1.5TiB") == (1.5 * 2**40, False)
    assert parse_threshold("100000", binary=False) == (100000, False)
    assert parse_threshold("2M", binary=False) == (2_000_000, False)
    for bad in ("lots", "120%", "-5%", "5 parsecs"):
        with pytest.raises(ValueError):
            parse_threshold(bad)


def test_run_table_overrides_site_key_by_key_and_errors_name_file_and_key(tmp_path: Path):
    site = (SITE_CONFIGS_DIR / "local.toml").read_text()
    site_file = tmp_path / "team.toml"
    site_file.write_text(
        site + '\n[watchdogs]\npartition = "cpu"\nreminder = "2h"\n'
        '[watchdogs.webhook]\nurl_file = "hook.url"\n[watchdogs.hang]\nstale_after = "45m"\n'
    )
    spec = load_run(
        doctor_spec(
            tmp_path,
            "wd-spec",
            site="team.toml",
            extra='[watchdogs.hang]\nevery = "5m"\n[watchdogs.disk]\npaths = ["data"]',
        )
    )
    w = spec.run.watchdogs
    assert (w.partition, w.reminder, w.hang.stale_after, w.hang.every) == ("cpu", 7200, 45 * 60, 300)
    assert w.webhook.url_file == str(tmp_path / "hook.url")  # relative to the site file
    assert w.disk.paths == [str(tmp_path / "data")]  # relative to run.toml

    with pytest.raises(SpecError) as err:
        load_run(
            doctor_spec(
                tmp_path, "wd-spec", extra='[watchdogs.hang]\nevery = "30s"\n[watchdogs.disk]\nmin_free = "lots"'
            )
        )
    text = str(err.value)
    assert "run.toml: watchdogs.hang.every: " in text and "at least 1m" in text
    assert "run.toml: watchdogs.disk.min_free: " in text
    site_file.write_text(site + '\n[watchdogs.email]\nto = ["a@b"]\npassword_env = "PW"\n')
    with pytest.raises(SpecError) as err:
        load_run(doctor_spec(tmp_path, "wd-spec", site="team.toml"))
    assert f"{site_file}: watchdogs.email: " in str(err.value) and "needs a username" in str(err.value)


def test_jobgen_schema_documents_the_watchdogs_table():
    schema = json.loads(jobgen("schema", check=True).stdout)
    props = schema["$defs"]["WatchdogSettings"]["properties"]
    assert {"disk", "running", "hang", "memory", "email", "webhook", "reminder", "log_retention"} <= set(props)
    assert all(p.get("description") for p in props.values())


# ---------------------------------------------------------------- disk


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 2 MiB tmpfs with 64 inodes: big files and many files both fill it quickly."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=64", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _disk(*args: str) -> subprocess.CompletedProcess[str]:
    return jobgen("watchdog", "run", "disk", *args)


def test_disk_check_fires_on_bytes_then_on_inodes(small_fs: Path):
    quiet = _disk("--path", str(small_fs))
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert "ok" in quiet.stdout

    (small_fs / "big").write_bytes(b"\0" * (1900 * 1024))
    full = _disk("--path", str(small_fs))
    assert full.returncode == 1 and "below min_free 20%" in full.stdout, full.stdout
    # An absolute threshold works too, and a lower one clears it.
    assert _disk("--path", str(small_fs), "--min-free", "100K").returncode == 0
    assert _disk("--path", str(small_fs), "--min-free", "1M").returncode == 1

    (small_fs / "big").unlink()
    for i in range(60):
        (small_fs / f"f{i}").touch()
    inodes = _disk("--path", str(small_fs), "--json")
    result = json.loads(inodes.stdout)
    assert inodes.returncode == 1 and "inodes free" in result["summary"] and "min_free_inodes 10%" in result["summary"]
    assert result["data"]["filesystems"][0]["total_inodes"] == 64
    # What the check cost is part of its result, and of the line its scheduler logs.
    assert result["data"]["cost"]["seconds"] > 0 and 0 < result["data"]["cost"]["peak_rss_mib"] < 1024
    # The same through python -m, as a job file runs it.
    proc = subprocess.run(
        [str(REPO / ".venv/bin/python"), "-m", "watchdogs.disk", "--path", str(small_fs), "--min-free-inodes", "2"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^watchdogs\.disk: checked in \d+\.\d\d s, peak RSS \d+ MiB$", proc.stdout, re.M), proc.stdout


def test_usage_errors_exit_2_and_options_may_come_before_run(tmp_path: Path):
    help_text = jobgen("watchdog", "run", "--help")
    assert help_text.returncode == 0 and "NAME is one of: disk, running, hang, memory" in help_text.stdout
    assert jobgen("watchdog", "run", "bogus").returncode == 2
    assert jobgen("watchdog", "run", "disk", "--min-free", "100%", "--path", str(tmp_path)).returncode == 1
    assert jobgen("watchdog", "run", "disk").returncode == 2
    assert jobgen("watchdog", "run", "hang").returncode == 2
    assert jobgen("watchdog", "run", "disk", "--path", "/", "--min-free", "lots").returncode == 2
    assert jobgen("watchdog", "run", "running", "no-such-run").returncode != 0


def _run_with_checkpoints(tmp_path: Path, sizes_and_ages: list[tuple[int, float]], keep: int) -> Target:
    """A run directory (via the real submit path's materialize) with fake complete checkpoints."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.runs.rundir import RunDir

    spec = load_run(
        run_spec(
            tmp_path,
            "fc",
            job={"time": "1h", "runs_root": tmp_path / "runs"},
            model={"path": EXAMPLES_DIR},
            data={"path": DATA},
            train={"keep_checkpoints": keep, "save_every": "1h"},
        )
    )
    run, _ = materialize(spec, render(spec), None)
    now = time.time()
    for i, (size, age) in enumerate(sizes_and_ages):
        d = run.path / "checkpoints" / f"step-{(i + 1) * 100:08d}"
        d.mkdir()
        (d / "shard").write_bytes(b"x" * size)
        os.utime(d, (now - age, now - age))
    return Target(settings=spec.run.watchdogs, run=RunDir(run.path), spec=spec)


def test_forecast_follows_keep_checkpoints_and_the_observed_interval(tmp_path: Path):
    from watchdogs.disk import forecast

    target = _run_with_checkpoints(tmp_path, [(400_000, 7200), (400_000, 3600)], keep=5)
    fc = forecast(target, free_bytes=10**9)
    assert fc.basis == "observed" and abs(fc.interval_seconds - 3600) < 5
    assert fc.complete == 2 and fc.extra_bytes_needed == 4 * fc.checkpoint_bytes and fc.hours_left is None
    # Room for one more checkpoint only: the second save from now does not fit, in about 2 h.
    tight = forecast(target, free_bytes=int(fc.checkpoint_bytes * 1.5))
    assert tight.hours_left == pytest.approx(2.0, abs=0.01)
    # At keep = 2 a run holding 2 needs one transient checkpoint more, not more and more.
    steady = _run_with_checkpoints(tmp_path / "b", [(400_000, 7200), (400_000, 3600)], keep=2)
    assert forecast(steady, free_bytes=10**9).extra_bytes_needed == fc.checkpoint_bytes


# ---------------------------------------------------------------- notifications


def test_decide_sends_one_alert_then_reminders_then_one_resolved():
    sent, state = [], None
    clock = 1000.0
    for alert in [True] * 7 + [False] * 3 + [True]:
        kind, state = decide(state, alert, "x", clock, reminder=300)
        sent.append(kind)
        clock += 100
    assert sent == [ALERT, None, None, REMINDER, None, None, REMINDER, RESOLVED, None, None, ALERT]
    undelivered = AlertState("alert", 0, 10, "x", undelivered=True)
    assert decide(undelivered, True, "x", 20, reminder=300)[0] == REMINDER


@pytest.fixture
def receivers():
    with local_receivers("127.0.0.1") as got:
        yield got


def test_email_and_webhook_get_one_alert_reminders_and_one_resolved(tmp_path: Path, receivers, monkeypatch):
    monkeypatch.setenv("JG_HOOK", f"http://127.0.0.1:{receivers['http_port']}/hook")
    settings = WatchdogSettings.model_validate(
        {
            "reminder": "1h",
            "email": {"to": ["oncall@example.org"], "host": "127.0.0.1", "port": receivers["smtp_port"]},
            "webhook": {"url_env": "JG_HOOK"},
        }
    )
    target = Target(settings=settings, home_override=tmp_path / "home")
    clock = 1_000_000.0
    kinds = []
    # Failing every 10 minutes for 2h40m (16 runs), then recovered twice.
    for i in range(16):
        result = CheckResult("disk", "/scratch", True, f"/scratch: 3% free (run {i})")
        kinds.append(deliver(result, target, now=clock))
        clock += 600
    for _ in range(2):
        kinds.append(deliver(CheckResult("disk", "/scratch", False, "/scratch: 40% free"), target, now=clock))
        clock += 600
    assert kinds == [ALERT] + [None] * 5 + [REMINDER] + [None] * 5 + [REMINDER] + [None] * 3 + [RESOLVED, None]

    subjects = [
        str(email.message_from_string(m["data"], policy=email.policy.default)["Subject"]) for m in receivers["mails"]
    ]
    assert len(subjects) == 4 and all(m["to"] == ["oncall@example.org"] for m in receivers["mails"])
    assert subjects[0].startswith("[jobgen watchdog] ALERT disk /scratch: /scratch: 3% free (run 0)")
    assert [s.split()[2] for s in subjects] == ["ALERT", "REMINDER", "REMINDER", "RESOLVED"]
    texts = [p["text"] for p in receivers["posts"]]
    assert [t.split()[2] for t in texts] == ["ALERT", "REMINDER", "REMINDER", "RESOLVED"]
    assert all(p["type"] == "application/json" for p in receivers["posts"])
    assert "RESOLVED disk /scratch after 2h40m" in texts[-1]
    log = (tmp_path / "home" / "watchdog.log").read_text()
    assert log.count("[jobgen watchdog] ") == 4


def test_a_channel_that_fails_is_retried_next_run_and_never_blocks_the_log(tmp_path: Path, receivers):
    settings = WatchdogSettings.model_validate(
        {
            "webhook": {"url": "http://127.0.0.1:9/nothing-listens-here"},
            "email": {
                "to": ["a@b"],
                "host": "127.0.0.1",
                "port": receivers["smtp_port"],
                "username": "u",
                "password_file": str(tmp_path / "missing-password"),
            },
        }
    )
    target = Target(settings=settings, home_override=tmp_path / "home")
    assert deliver(CheckResult("hang", "r", True, "stuck"), target, now=100) == ALERT
    assert deliver(CheckResult("hang", "r", True, "stuck"), target, now=160) == REMINDER  # retried at once
    log = (tmp_path / "home" / "watchdog.log").read_text()
    assert log.count("ALERT hang r: stuck") == 1 and "could not deliver ALERT hang r: webhook: " in log
    assert "email: FileNotFoundError" in log and receivers["mails"] == []


@pytest.mark.parametrize(
    "hook",
    [
        "hooks.slack.com/services/T0/B0/tok3nSECRET",  # urllib: "unknown url type: '<the url>'"
        "https://hooks.slack.com:tok3nSECRET/services/T0",  # http.client: "nonnumeric port: '<part of it>'"
        "https://hooks.slack.com/services/T0/B0/tok3nSECRET\x01",  # "URL can't contain control characters. <url>"
    ],
)
def test_a_broken_secret_is_never_quoted_in_an_error(tmp_path: Path, hook: str):
    """The webhook URL (and the SMTP password) are secrets read from a file at send time;
    when they are unusable, the failure names the file, never its content."""
    url_file = tmp_path / "hook.url"
    url_file.write_text(hook + "\n")
    settings = WatchdogSettings.model_validate({"webhook": {"url_file": str(url_file)}})
    target = Target(settings=settings, home_override=tmp_path / "home")
    assert deliver(CheckResult("disk", "/scratch", True, "3% free"), target, now=100) == ALERT
    log = (tmp_path / "home" / "watchdog.log").read_text()
    assert "could not deliver ALERT disk /scratch: webhook: " in log
    assert "tok3n" not in log and "SECRET" not in log, log
    assert f"url in file {url_file}" in log or f"url from file {url_file}" in log, log  # where to look


def test_a_threshold_from_the_command_line_is_text_and_still_a_number():
    """`jobgen watchdog run memory RUN --max-percent 99.9`: the [watchdogs] tables are strict (a
    TOML value of the wrong type is an error), and a command line's values are all text."""
    import argparse
    import types

    from jobgen.spec.tables.watchdogs import WatchdogSettings
    from watchdogs.base import apply_overrides

    target = types.SimpleNamespace(settings=WatchdogSettings())
    apply_overrides(target, "memory", argparse.Namespace(max_percent="99.9"))
    assert target.settings.memory.max_percent == 99.9
