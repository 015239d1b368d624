"""What a check looks at and what it finds: :class:`Target` (a run, its spec and settings,
and/or plain paths), :class:`CheckResult`, and the watchdog home a run's alerts live in.

Below both :mod:`watchdogs.base` (the checks' command line) and :mod:`watchdogs.notify`
(alert state and delivery), which each use these.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobgen.base.visible import visible
from jobgen.runs.rundir import RunDir, default_runs_root
from jobgen.runs.sweep_runs import find_run_or_point
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.watchdogs import WatchdogSettings

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
        """The result for a person: its summary and details are built from a run's files and
        Slurm's words, so their control characters are shown as escapes (jobgen.base.visible)."""
        word = "ALERT" if self.alert else "ok"
        head = f"{self.check} {visible(self.target)}: {word}: {visible(self.summary)}"
        return "\n".join([head, *(f"  {visible(d)}" for d in self.details)])


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
        run = find_run_or_point(run_ref, default_runs_root())
        spec = run.load_spec()
        settings = spec.run.watchdogs
    return Target(
        settings=settings,
        run=run,
        spec=spec,
        paths=[Path(p).absolute() for p in paths],
        home_override=Path(home).absolute() if home else None,
    )
