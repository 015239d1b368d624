"""Watching a whole runs root: every active run in it, the runs root's filesystem, and the
runs that become active later; and every watchdog home a user has.

    jobgen watchdog install                # what `install_root` does, once, by hand
    python -m watchdogs.runs_root --runs-root DIR [--partition P]   # the sweep job file

``jobgen watchdog install`` without a run installs each active (pending or running) run's
checks in that run's own watchdog home, as ``jobgen watchdog install RUN`` does, then two
job files in the runs root's home (``<runs_root>/.watchdogs``): ``runs-root.disk``, the
disk check of the runs root itself, and ``runs-root.sweep``, which runs this module every
``RUNNING_EVERY`` to do the same for runs submitted since. A run that ends keeps its job
files until ``jobgen watchdog remove RUN``: its ``running`` check is what says it stopped.

Homes: chains carry their home in their Slurm comment, and ``install`` notes each home it
used in the user's state directory (``$XDG_STATE_HOME/jobgen/watchdog-homes.json``), so
``list`` and ``remove`` without a run reach homes under other runs roots too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from jobgen.base.atomic import write_json_atomic
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm
from jobgen.spec.tables.watchdogs import WatchdogSettings
from watchdogs import CHECKS
from watchdogs.scheduler import ALWAYS, WatchdogHome, chain_job_name, ensure_chain, install_run, write_job_file
from watchdogs.target import watchdog_home

ROOT_PREFIX = "runs-root"  # job files of the root itself: runs-root.disk, runs-root.sweep
# How often the sweep looks for newly active runs: the running check's default interval.
RUNNING_EVERY = WatchdogSettings().running.every


def homes_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "jobgen" / "watchdog-homes.json"


def remember_home(path: Path) -> None:
    """Note a home ``install`` used, so ``list``/``remove`` without a run find it later."""
    known = _remembered()
    if str(path) in known:
        return
    try:
        homes_file().parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(homes_file(), sorted({*known, str(path)}))
    except OSError as exc:  # a convenience for list/remove: never a reason to fail an install
        print(f"note: could not record watchdog home {path} in {homes_file()}: {exc.strerror}", file=sys.stderr)


def _remembered() -> list[str]:
    try:
        value = json.loads(homes_file().read_text())
    except (OSError, ValueError):
        return []
    return [str(p) for p in value] if isinstance(value, list) else []


def known_homes(runs_root: Path | None) -> list[WatchdogHome]:
    """Every watchdog home of this user: the runs root's, those ``install`` noted, and those
    of the chains Slurm has queued for the user (their comment). Only homes that exist."""
    paths = set(_remembered())
    if runs_root is not None:
        paths.add(str(runs_root / ".watchdogs"))
    try:
        paths |= {job.comment for name, job in slurm.my_jobs() if name.startswith(chain_job_name("")) and job.comment}
    except slurm.SlurmError:
        pass  # the homes noted on disk still count
    return [WatchdogHome(Path(p)) for p in sorted(paths) if Path(p).is_dir()]


def active_runs(runs_root: Path) -> list[RunDir]:
    """The runs under ``runs_root`` with a task pending or running: one squeue call."""
    from jobgen.report.status import queue_for, run_status, unreadable

    runs = [RunDir(p.parent) for p in sorted(runs_root.glob("*/spec.json"))]
    runs = [r for r in runs if unreadable(r) is None]
    queue = queue_for(runs)
    return [r for r in runs if run_status(r, queue=queue, details=False).state in ("pending", "running")]


def _python_line(module: str, *args: str) -> str:
    return f"exec {shlex.quote(sys.executable)} -m {module} {' '.join(shlex.quote(a) for a in args)}\n"


def install_root(runs_root: Path, partition: str | None, *, skip_installed: bool = False) -> list[str]:
    """Each active run's checks, then the runs root's own job files and their chains.
    ``skip_installed``: leave runs that have their job files already (the sweep)."""
    lines = []
    for run in active_runs(runs_root):
        spec = run.load_spec()
        home = WatchdogHome(watchdog_home(spec))
        if skip_installed and home.job_files_of_run(spec.run.job.name):
            continue
        lines.append(f"run {spec.run.job.name}:")
        lines += [f"  {line}" for line in install_run(home, run.path, spec, partition)]
        remember_home(home.path)
    home = WatchdogHome(runs_root / ".watchdogs")
    settings = WatchdogSettings()
    root = str(runs_root)
    disk = _python_line("watchdogs.disk", "--path", root, "--home", str(home.path), "--notify")
    sweep = _python_line("watchdogs.runs_root", "--runs-root", root, *(["--partition", partition] if partition else []))
    header = "#!/bin/sh\n# Installed by `jobgen watchdog install`; remove with: jobgen watchdog remove\n"
    files = {
        f"{ROOT_PREFIX}.disk": (settings.disk.every, header + disk),
        f"{ROOT_PREFIX}.sweep": (RUNNING_EVERY, header + sweep),
    }
    for name, (every, text) in files.items():
        lines.append(f"job file {write_job_file(home, every, name, text)}")
    for seconds in sorted(set(ALWAYS) | {every for every, _ in files.values()}):
        chain, new = ensure_chain(
            home,
            seconds,
            partition=partition or settings.partition,
            account=settings.account,
            time_limit=settings.time,
            log_retention=settings.log_retention,
        )
        lines.append(f"chain {chain.name:<7} {'started' if new else 'already running'}: job {chain.job_id}")
    remember_home(home.path)
    return lines


def root_job_files(home: WatchdogHome) -> list[Path]:
    ours = {f"{ROOT_PREFIX}.{name}" for name in (*CHECKS, "sweep")}
    return [p for p in home.path.glob(f"cron.*/{ROOT_PREFIX}.*") if p.name in ours]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Install the watchdogs of runs under a runs root that became active.")
    parser.add_argument("--runs-root", type=Path, required=True)
    parser.add_argument("--partition")
    args = parser.parse_args(argv)
    for line in install_root(args.runs_root.absolute(), args.partition, skip_installed=True):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
