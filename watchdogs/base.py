"""What every check shares: its target, its result, its command line.

Each check module (``watchdogs.disk``, ``.running``, ``.hang``, ``.memory``) has a
``check(target) -> CheckResult`` and a ``main()`` built on :func:`main` here, so
all of them take the same options::

    python -m watchdogs.disk --run RUN [--path P]... [--min-free 20%] [--notify] [--json]

Exit status: 0 all clear, 1 alert (including "could not check": a blind watchdog is
worth a message), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jobgen.loader import ResolvedSpec
from jobgen.rundir import RunDir, RunDirError, default_runs_root, find_run
from jobgen.watchdog_settings import WatchdogSettings

OK, ALERT, USAGE = 0, 1, 2


@dataclass
class CheckResult:
    check: str
    target: str  # the run's name, or the paths checked
    alert: bool
    summary: str  # one line: what a person reads first
    details: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)

    @property
    def exit_code(self) -> int:
        return ALERT if self.alert else OK

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        word = "ALERT" if self.alert else "ok"
        return "\n".join([f"{self.check} {self.target}: {word}: {self.summary}", *(f"  {d}" for d in self.details)])


@dataclass
class Target:
    """What a check looks at: a run (its directory and spec) and/or plain paths."""

    settings: WatchdogSettings
    run: RunDir | None = None
    spec: ResolvedSpec | None = None
    paths: list[Path] = field(default_factory=list)
    home_override: Path | None = None

    @property
    def name(self) -> str:
        if self.spec is not None:
            return self.spec.run.job.name
        return ",".join(str(p) for p in self.paths) or "-"

    @property
    def home(self) -> Path | None:
        """The scheduler's directory, where alert state and the watchdog log live."""
        if self.home_override is not None:
            return self.home_override
        if self.spec is not None:
            return watchdog_home(self.spec)
        return Path(self.settings.home) if self.settings.home else None


def watchdog_home(spec: ResolvedSpec) -> Path:
    return Path(spec.run.watchdogs.home) if spec.run.watchdogs.home else spec.runs_root / ".watchdogs"


def load_target(run_ref: str | None, paths: list[str], home: str | None = None) -> Target:
    """A run given by name or directory (its spec.json holds the effective [watchdogs]),
    or only paths with default settings."""
    run = spec = None
    settings = WatchdogSettings()
    if run_ref:
        run = find_run(run_ref, default_runs_root())
        spec = run.load_spec()
        settings = spec.run.watchdogs
    return Target(
        settings=settings,
        run=run,
        spec=spec,
        paths=[Path(p).absolute() for p in paths],
        home_override=Path(home).absolute() if home else None,
    )


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
        updated = type(target.settings.check(name)).model_validate(table)
        target.settings = target.settings.model_copy(update={name: updated})


def main(name: str, check: Callable[[Target], CheckResult], description: str, argv: list[str] | None = None) -> int:
    """Parse, build the target, run the check, report; the exit status says whether it alerted."""
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
    except (RunDirError, ValidationError, ValueError, OSError) as exc:
        print(f"watchdogs.{name}: {exc}", file=sys.stderr)
        return USAGE
    try:
        result = check(target)
    except Exception as exc:  # noqa: BLE001 - a check that breaks must still say so, and alert
        result = CheckResult(name, target.name, True, f"could not check: {type(exc).__name__}: {exc}")
    if args.notify:
        from watchdogs.notify import deliver

        sent = deliver(result, target)
        if sent:
            result.data["notified"] = sent
    print(json.dumps(result.to_json(), indent=2) if args.json else result.text())
    sys.stdout.flush()
    return result.exit_code


@dataclass
class RunningJob:
    job_id: int
    nodes: list[str]
    start_time: float | None  # epoch seconds


def running_jobs(run: RunDir) -> list[RunningJob]:
    """The run's jobs (array tasks) Slurm has RUNNING now, with their nodes and start time."""
    from jobgen import slurm
    from jobgen.status import run_status

    out = []
    for task in run_status(run, details=False).tasks:
        if task.state in slurm.JOB_RUNNING:
            out.append(RunningJob(task.job_id, slurm.hostnames(task.nodes or ""), task.start_time))
    return out
