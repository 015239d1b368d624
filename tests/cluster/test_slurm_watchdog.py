"""Watchdogs on the dev cluster: the cron chains, and the running, hang and memory
checks against a real training job, with alerts delivered by email and webhook to
servers this test starts on the controller's address (the nodes live in their own
network namespaces, so 127.0.0.1 would be their own loopback).

One training run (1 node x 2 processes) is watched by 1-minute chains through the
whole module; the tests run in file order while the chains tick, so the minutes the
chain needs overlap with the other scenarios.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from helpers import (
    DATA,
    VENV_BIN,
    jobgen,
    local_receivers,
    paced,
    run_spec,
    submit,
    submitted_job_id,
    wait_for,
    wait_until_gone,
)
from jobgen.runtime.stacks import rank_processes
from jobgen.slurm import client as slurm
from watchdogs.notify import locked

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

STALE = 20  # seconds: the hang threshold of this run


@pytest.fixture(scope="module")
def watched(cluster, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    tmp = tmp_path_factory.mktemp("watchdog")
    name = f"wd-{uuid.uuid4().hex[:6]}"
    with local_receivers(cluster.controller_addr) as got:
        # Not helpers.train_spec: this job runs through the whole module, and the jobs of
        # train_spec's runs are cancelled after each test.
        spec = run_spec(
            tmp,
            name,
            job={"nodes": 1, "procs_per_node": 2, "time": "10m", "exit_grace": "1m", "runs_root": tmp / "runs"},
            model={"path": tiny_model},
            data={"path": DATA, "max_length": 256},
            train={"max_steps": 1000000, "save_every_steps": 0, "log_every_steps": 1, "lr": 1e-3},
            env=paced(),
            extra=f"""
            [watchdogs]
            partition = "debug"
            time = "3m"
            reminder = "1h"
            [watchdogs.running]
            every = "1m"
            [watchdogs.hang]
            every = "1m"
            stale_after = "{STALE}s"
            [watchdogs.memory]
            every = "1m"
            max_percent = 1
            [watchdogs.disk]
            every = "1m"
            [watchdogs.email]
            to = ["oncall@example.org"]
            host = "{cluster.controller_addr}"
            port = {got["smtp_port"]}
            [watchdogs.webhook]
            url = "http://{cluster.controller_addr}:{got["http_port"]}/hook"
        """,
        )
        job_id = submitted_job_id(jobgen("submit", str(spec), check=True).stdout)
        run = tmp / "runs" / name
        try:
            yield {
                "name": name,
                "spec": spec,
                "run": run,
                "home": tmp / "runs" / ".watchdogs",
                "job_id": job_id,
                "got": got,
            }
        finally:
            jobgen("watchdog", "remove", "--home", str(tmp / "runs" / ".watchdogs"))
            subprocess.run(["scancel", f"--name={name}"], capture_output=True)


def chain_jobs(home: Path, interval: str) -> list[slurm.NamedJob]:
    return [j for j in slurm.jobs_named(f"jobgen-cron-{interval}") if j.comment == str(home)]


def test_an_install_slurm_refuses_leaves_nothing_behind(watched):
    refused = jobgen("watchdog", "install", str(watched["run"]), "--partition", "nosuch")
    assert refused.returncode != 0 and "nothing installed" in refused.stderr, refused.stderr
    assert "partition" in refused.stderr.lower(), refused.stderr
    assert not list(watched["home"].glob("cron.*/*")) and not list(watched["home"].glob("chains/*.json"))
    assert not any(chain_jobs(watched["home"], i) for i in ("1m", "hourly", "daily"))


def test_install_starts_one_chain_per_interval_and_a_second_install_does_not_double(watched):
    first = jobgen("watchdog", "install", str(watched["spec"]), check=True)
    assert "chain 1m      started" in first.stdout and "chain hourly  started" in first.stdout, first.stdout
    for check in ("disk", "running", "hang", "memory"):
        assert os.access(watched["home"] / "cron.1m" / f"{watched['name']}.{check}", os.X_OK)
    second = jobgen("watchdog", "install", str(watched["run"]), check=True)
    assert second.stdout.count("already running") == 3, second.stdout
    for interval in ("1m", "hourly", "daily"):
        assert_one_chain(watched["home"], interval)


def assert_one_chain(home: Path, interval: str) -> None:
    """One chain: the link its record names is queued or running, and any other job of the
    interval is the link before it, still running after it queued its successor (a 1-minute
    chain hands over while a slow test looks); never a second queued link."""
    jobs = chain_jobs(home, interval)
    recorded = json.loads((home / "chains" / f"{interval}.json").read_text())["job_id"]
    others = [j for j in jobs if j.job_id != recorded]
    assert [j.job_id for j in jobs if j.job_id == recorded] == [recorded], (interval, recorded, jobs)
    assert len(others) <= 1 and all(j.state in ("RUNNING", "COMPLETING") for j in others), (interval, jobs)


def test_install_without_a_run_watches_every_active_run_and_the_runs_root(watched, cluster_run, tmp_path):
    """`jobgen watchdog install` as the mission types it: the active runs of the runs root
    (each in its own home), the runs root's filesystem, and a sweep for runs submitted later."""
    root = tmp_path / "runs2"
    name = f"wd2-{uuid.uuid4().hex[:6]}"
    job = submit(cluster_run(name, runs_root=root).spec)
    wait_for(lambda: slurm.queue([job]), 30, "the second run queued")
    env = {"JOBGEN_RUNS_ROOT": str(root)}
    out = jobgen("watchdog", "install", env=env, check=True).stdout
    home = root / ".watchdogs"
    assert f"run {name}:" in out and "runs root" in out, out
    for check in ("disk", "running", "hang", "memory"):
        assert list(home.glob(f"cron.*/{name}.{check}")), check
    disk, sweep = home / "cron.hourly" / "runs-root.disk", home / "cron.10m" / "runs-root.sweep"
    assert os.access(disk, os.X_OK) and os.access(sweep, os.X_OK)
    for interval in ("10m", "hourly", "daily"):
        assert_one_chain(home, interval)  # the first link may still run beside its successor
    # Each job file does its work as the chain runs it: the root's disk check, and a sweep
    # that finds nothing new to install (the run has its job files).
    checked = subprocess.run(["sh", str(disk)], capture_output=True, text=True, timeout=120)
    # Exit 1 is an alert: this machine's own disk may be below the 20 % default.
    assert checked.returncode in (0, 1) and f"{root}: " in checked.stdout and " free of " in checked.stdout, (
        checked.stdout + checked.stderr
    )
    swept = subprocess.run(["sh", str(sweep)], capture_output=True, text=True, timeout=120)
    assert swept.returncode == 0 and name not in swept.stdout, swept.stdout + swept.stderr
    # A second install adds nothing; list without a run shows every home the user has.
    again = jobgen("watchdog", "install", env=env, check=True).stdout
    assert "started" not in again, again
    listing = jobgen("watchdog", "list", env=env, check=True).stdout
    assert f"home {home}" in listing and f"home {watched['home']}" in listing, listing
    assert "runs-root.disk" in listing and f"{name}.running" in listing


def _check(watched, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return jobgen("watchdog", "run", name, str(watched["run"]), *args, timeout=180)


def job_node(job_id: int) -> str:
    records = [r for r in slurm.show_job(job_id) if r.get("JobState") == "RUNNING"]
    assert records, slurm.show_job(job_id)
    return slurm.hostnames(records[0]["NodeList"])[0]


def test_memory_fires_with_a_low_threshold(watched):
    wait_for(lambda: (watched["run"] / "metrics.jsonl").is_file(), 120, "training started")
    high = _check(watched, "memory")
    node = job_node(watched["job_id"])
    assert high.returncode == 1 and f"{node}:" in high.stdout and "above max_percent 1%" in high.stdout, high.stdout
    assert _check(watched, "memory", "--max-percent", "99.9").returncode == 0


def test_running_and_hang_stay_quiet_while_it_trains(watched):
    running = _check(watched, "running")
    assert running.returncode == 0 and "1 running" in running.stdout, running.stdout
    hang = _check(watched, "hang")
    assert hang.returncode == 0 and "last progress" in hang.stdout, hang.stdout


def test_hang_fires_when_a_rank_stops_and_dumps_every_rank(watched):
    ranks = rank_processes(str(watched["job_id"]), job_node(watched["job_id"]))
    assert [r for r, _, _ in ranks] == [0, 1], ranks
    os.kill(ranks[1][2], signal.SIGSTOP)  # rank 1 stops; rank 0 waits for it in the next all-reduce
    metrics = watched["run"] / "metrics.jsonl"
    wait_for(lambda: time.time() - metrics.stat().st_mtime > STALE + 2, 90, "metrics stopped")
    hang = _check(watched, "hang", "--json")
    result = json.loads(hang.stdout)
    assert hang.returncode == 1 and "no progress for" in result["summary"], result
    dump = Path(result["data"]["jobs"][0]["stacks"])
    assert str(dump) in result["summary"] and dump.parent == watched["run"] / "hangs"
    text = dump.read_text()
    # Both ranks' Python stacks, each inside the training loop (where exactly depends on the
    # instant rank 1 stopped: a backward's all-reduce, or the loop's own).
    assert "rank 0 (local 0)" in text and "rank 1 (local 1)" in text, text
    assert text.count("Trainer.fit (trainer/loop.py") == 2, text


def test_running_fires_when_the_array_is_cancelled(watched):
    slurm.cancel(watched["job_id"])
    wait_until_gone([watched["job_id"]], timeout=120)
    gone = _check(watched, "running", "--notify")  # as the job file runs it: the alert state records it
    assert gone.returncode == 1 and "has not finished" in gone.stdout, gone.stdout
    assert f"jobgen submit {watched['spec']}" in gone.stdout
    status = jobgen("status", str(watched["run"]), check=True).stdout
    assert "WARNING  watchdog running: no job running or pending" in status, status


def test_the_chain_runs_the_checks_every_minute_and_alerts_reach_email_and_webhook(watched):
    logs = watched["home"] / "logs" / "1m"
    marker = f"{watched['name']}.running: exit"

    def ticks() -> list[Path]:
        done = [p for p in logs.glob("*_0_log.out") if marker in p.read_text(errors="replace")]
        return done if len(done) >= 2 else []

    ran = wait_for(ticks, 240, "two ticks of the 1m chain", interval=3)
    assert len({p.name.split("_")[0] for p in ran}) >= 2
    listing = jobgen("watchdog", "list", str(watched["run"]), check=True).stdout
    assert "cron.1m: job" in listing and f"{watched['name']}.memory" in listing, listing

    posts = [p["text"] for p in watched["got"]["posts"]]
    memory_alerts = [t for t in posts if t.startswith(f"[jobgen watchdog] ALERT memory {watched['name']}")]
    # Two or more ticks saw memory above 1 %, or the job gone: one alert, never one per tick.
    assert len(memory_alerts) == 1, posts
    running_alerts = [t for t in posts if t.startswith(f"[jobgen watchdog] ALERT running {watched['name']}")]
    assert len(running_alerts) == 1, posts  # by hand, then by the chain: still one
    subjects = [m["data"] for m in watched["got"]["mails"]]
    assert sum(f"ALERT memory {watched['name']}" in s for s in subjects) == 1, subjects
    run_log = (watched["run"] / "logs" / "watchdog.log").read_text()
    assert f"ALERT memory {watched['name']}" in run_log
    assert f"ALERT memory {watched['name']}" in (watched["home"] / "watchdog.log").read_text()


def test_remove_during_a_hand_over_leaves_nothing_queued(watched):
    """Remove while a link of the 1-minute chain hands over: the test holds the chain's lock
    until the next link runs and waits for it, then starts remove and lets go. Whichever
    takes the lock first, the link queueing its successor or remove forgetting the chain,
    nothing of any chain is left in Slurm's queue when remove returns (it once left the running
    link and the successor it had just queued)."""
    home = watched["home"]
    with locked(home / "chains" / "1m.lock"):  # the next link starts and waits here, mid-hand-over
        wait_for(
            lambda: any(j.state == "RUNNING" for j in chain_jobs(home, "1m")),
            150,
            "the next link of the 1m chain to start",
            interval=2,
        )
        remover = subprocess.Popen(
            [str(VENV_BIN / "jobgen"), "watchdog", "remove", str(watched["run"])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    out, _ = remover.communicate(timeout=300)
    assert remover.returncode == 0 and "chain 1m stopped" in out, out
    left = {i: chain_jobs(home, i) for i in ("1m", "hourly", "daily")}
    assert not any(left.values()), left
    assert not list((home / "chains").glob("*.json"))
    assert not list((home / "cron.1m").iterdir())


def test_remove_without_a_run_stops_the_chains_of_every_home(watched):
    others = {p.resolve() for p in watched["home"].parents[2].glob("*/runs2/.watchdogs")}
    homes = [watched["home"], *others]
    assert len(homes) == 2, homes  # this module's run's home, and the runs root the test above watched
    out = jobgen("watchdog", "remove", check=True).stdout
    for home in homes:
        assert f"home {home}" in out, out
    assert "removed" in out and "runs-root.sweep" in out, out
    left = [j for home in homes for i in ("1m", "10m", "hourly", "daily") for j in chain_jobs(home, i)]
    assert not left, left  # nothing queued once remove returned
