"""What every check shares: its target, its result, its command line.

Each check module (``watchdogs.disk``, ``.running``, ``.hang``, ``.memory``) has a
``check(target) -> CheckResult`` and a ``main()`` built on :func:`main` here, so
all of them take the same options::

    python -m watchdogs.disk --run RUN [--path P]... [--min-free 20%] [--notify] [--json]

Exit status: 0 all clear, 1 alert (including "could not check": a blind watchdog is
worth a message, and a run whose spec.json is damaged is one), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from jobgen.base.safe_read import DamagedFile
from jobgen.runs.rundir import RunDir, RunDirError
from watchdogs.notify import deliver
from watchdogs.target import ALERT, USAGE, CheckResult, Target, load_target

# Options every check accepts; each maps onto a key of its settings table.
_OVERRIDES = {
    "disk": {"min_free": "--min-free", "min_free_inodes": "--min-free-inodes", "forecast": "--forecast"},
    "hang": {"stale_after": "--stale-after"},
    "memory": {"max_percent": "--max-percent"},
    "running": {},
}


def parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m watchdogs.{name}", description=description)
    p.add_argument("--run", dest="run_ref", metavar="RUN", help="run name (under the runs root) or directory")
    p.add_argument("--path", action="append", default=[], metavar="P", help="also check this path (repeatable)")
    p.add_argument("--home", help="watchdog home for --notify (default: the run's)")
    p.add_argument(
        "--notify",
        action="store_true",
        help="record the result and send alert / reminder / resolved messages as configured",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    for key, flag in _OVERRIDES[name].items():
        p.add_argument(flag, dest=key, help=f"override [watchdogs.{name}] {key}")
    return p


def apply_overrides(target: Target, name: str, args: argparse.Namespace) -> None:
    given = {key: getattr(args, key) for key in _OVERRIDES[name] if getattr(args, key) is not None}
    if given:
        table = target.settings.check(name).model_dump(mode="json") | given
        # Lax, unlike a TOML file's table: a command line's values are all text ("99.9").
        updated = type(target.settings.check(name)).model_validate(table, strict=False)
        target.settings = target.settings.model_copy(update={name: updated})


def main(name: str, check: Callable[[Target], CheckResult], description: str, argv: list[str] | None = None) -> int:
    """Parse, build the target, run the check, report; the exit status says whether it alerted.
    What the check itself cost (seconds, this process's peak RSS) ends its output: these run
    every few minutes for weeks, on the nodes and the login node, and must stay small."""
    started = time.monotonic()
    args = parser(name, description).parse_args(argv)
    if name != "disk" and not args.run_ref:
        print(f"watchdogs.{name}: --run RUN is required", file=sys.stderr)
        return USAGE
    if name == "disk" and not args.run_ref and not args.path:
        print("watchdogs.disk: give --run RUN and/or --path P", file=sys.stderr)
        return USAGE
    try:
        target = load_target(args.run_ref, args.path, args.home)
        apply_overrides(target, name, args)
    except DamagedFile as exc:  # the run's spec.json: a watchdog that cannot look is an alert
        print(f"watchdogs.{name}: ALERT: could not check: {exc}", file=sys.stderr)
        return ALERT
    except (RunDirError, ValidationError, ValueError, OSError) as exc:
        print(f"watchdogs.{name}: {exc}", file=sys.stderr)
        return USAGE
    try:
        result = check(target)
    except Exception as exc:  # noqa: BLE001 - a check that breaks must still say so, and alert
        result = CheckResult(name, target.name, True, f"could not check: {type(exc).__name__}: {exc}")
    if args.notify:
        sent = deliver(result, target)
        if sent:
            result.data["notified"] = sent
    cost = {
        "seconds": round(time.monotonic() - started, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    result.data["cost"] = cost
    print(json.dumps(result.to_json(), indent=2) if args.json else result.text())
    if not args.json:
        print(f"watchdogs.{name}: checked in {cost['seconds']:.2f} s, peak RSS {cost['peak_rss_mib']:.0f} MiB")
    sys.stdout.flush()
    return result.exit_code


@dataclass
class RunningJob:
    job_id: int
    nodes: list[str]
    start_time: float | None  # epoch seconds


def running_jobs(run: RunDir) -> list[RunningJob]:
    """The run's jobs (array tasks) Slurm has RUNNING now, with their nodes and start time."""
    from jobgen.report.status import run_status
    from jobgen.slurm import client as slurm

    out = []
    for task in run_status(run, details=False).tasks:
        if task.state in slurm.JOB_RUNNING:
            out.append(RunningJob(task.job_id, slurm.hostnames(task.nodes or ""), task.start_time))
    return out
