"""Disk check: free bytes and free inodes on every filesystem the run writes to, and a
forecast of whether the run's next checkpoints will fit.

    python -m watchdogs.disk --run RUN [--path P]... [--min-free 20%] [--min-free-inodes 10%]
    jobgen watchdog run disk RUN --path /scratch

Numbers are what an unprivileged user can use (``f_bavail``, ``f_favail``), because
the reserved blocks of ext4 are of no help to a training job. The forecast follows
the checkpointer: a run keeps ``keep_checkpoints`` complete checkpoints and writes
one more before pruning, so it needs ``(keep + 1) x size`` at its peak; with the
observed save interval that tells how many hours remain before a save cannot fit.

This module owns the thresholds and the forecast; which directories are complete
checkpoints is the run directory's layout (jobgen.runs.rundir.RunDir.complete_checkpoints).
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from jobgen.base.durations import format_human
from jobgen.runs.rundir import RunDir
from jobgen.runs.summary_cache import summarize
from jobgen.spec.tables.watchdogs import parse_threshold
from watchdogs.base import main as check_main
from watchdogs.target import CheckResult, Target


@dataclass
class Usage:
    path: Path
    total_bytes: int
    free_bytes: int
    total_inodes: int
    free_inodes: int

    @property
    def free_percent(self) -> float:
        return 100.0 * self.free_bytes / self.total_bytes if self.total_bytes else 100.0

    @property
    def free_inodes_percent(self) -> float | None:
        return 100.0 * self.free_inodes / self.total_inodes if self.total_inodes else None


def usage(path: Path) -> Usage:
    st = os.statvfs(path)
    return Usage(path, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, st.f_files, st.f_favail)


def gib(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _existing(path: Path) -> Path:
    """statvfs needs an existing path; a run dir not created yet lives on its parent's filesystem."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def low_space(u: Usage, min_free: str, min_free_inodes: str) -> list[str]:
    """The thresholds this filesystem is below, as sentences."""
    problems = []
    value, percent = parse_threshold(min_free)
    need = u.total_bytes * value / 100 if percent else value
    if u.free_bytes < need:
        problems.append(
            f"{u.path}: {gib(u.free_bytes)} free of {gib(u.total_bytes)} "
            f"({u.free_percent:.1f}%), below min_free {min_free}"
        )
    if u.total_inodes:  # btrfs, some NFS servers: no fixed inode table, nothing to run out of
        value, percent = parse_threshold(min_free_inodes, binary=False)
        need = u.total_inodes * value / 100 if percent else value
        if u.free_inodes < need:
            problems.append(
                f"{u.path}: {u.free_inodes} inodes free of {u.total_inodes} "
                f"({u.free_inodes_percent:.1f}%), below min_free_inodes {min_free_inodes}"
            )
    return problems


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue  # pruned while we walked
    return total


@dataclass
class Forecast:
    checkpoint_bytes: int
    interval_seconds: float | None
    complete: int
    keep: int
    extra_bytes_needed: int  # beyond what the run holds now, at its next peak
    hours_left: float | None  # until a save does not fit; None: it always fits
    basis: str

    def sentence(self) -> str:
        every = format_human(round(self.interval_seconds)) if self.interval_seconds else "?"
        head = (
            f"checkpoints {gib(self.checkpoint_bytes)} each, one every {every} ({self.basis}), "
            f"{self.complete} on disk, keep {self.keep}: the next peak needs {gib(self.extra_bytes_needed)} more"
        )
        if self.hours_left is None:
            return head + "; it fits"
        return head + f"; a save will not fit in about {self.hours_left:.1f} h"


def save_interval(
    run_dir: Path, steps: list[tuple[int, float]], save_every_steps: int, save_every: int
) -> tuple[float | None, str]:
    """Seconds between saves: observed between the newest checkpoints, else from the step
    rate in metrics.jsonl and the spec's save_every_steps / save_every."""
    if len(steps) >= 2:
        gaps = [b[1] - a[1] for a, b in itertools.pairwise(steps) if b[1] > a[1]]
        if gaps:
            return statistics.median(gaps), "observed"
    # (step, time) of the newest records, from the summary of metrics.jsonl: never its whole history.
    lines = list(summarize(RunDir(run_dir).metrics).recent)
    candidates = [float(save_every)] if save_every else []
    if len(lines) >= 2 and lines[-1][0] > lines[0][0] and save_every_steps:
        per_step = (lines[-1][1] - lines[0][1]) / (lines[-1][0] - lines[0][0])
        candidates.append(per_step * save_every_steps)
    return (min(candidates), "from the spec and step rate") if candidates else (None, "unknown")


def forecast(target: Target, free_bytes: int) -> Forecast | None:
    if target.run is None or target.spec is None:
        return None
    steps = [(step, path.stat().st_mtime, path) for step, path in target.run.complete_checkpoints()]
    if not steps:
        return None
    steps.sort()
    size = tree_bytes(steps[-1][2])
    train = target.spec.run.train
    interval, basis = save_interval(
        target.run.path, [(s, t) for s, t, _ in steps], train.save_every_steps, train.save_every
    )
    keep, held = train.keep_checkpoints, len(steps)
    # Save j from now needs the run to hold min(held + j, keep + 1) checkpoints at once.
    extra = max(1, keep + 1 - held) * size
    hours = None
    if size and extra > free_bytes:
        fitting = math.floor(free_bytes / size)  # saves that still fit before one does not
        hours = (fitting + 1) * interval / 3600 if interval else 0.0
    return Forecast(size, interval, held, keep, extra, hours, basis)


def check(target: Target) -> CheckResult:
    settings = target.settings.disk
    paths = ([target.run.path] if target.run else []) + [Path(p) for p in settings.paths] + target.paths
    seen: dict[int, Path] = {}
    problems, details, data = [], [], {"filesystems": []}
    for path in paths:
        real = _existing(path)
        dev = os.stat(real).st_dev
        if dev in seen:
            continue
        seen[dev] = path
        u = usage(real)
        u.path = path
        inodes = f", {u.free_inodes} inodes free ({u.free_inodes_percent:.1f}%)" if u.total_inodes else ""
        details.append(f"{path}: {gib(u.free_bytes)} free of {gib(u.total_bytes)} ({u.free_percent:.1f}%){inodes}")
        data["filesystems"].append(
            {
                "path": str(path),
                "total_bytes": u.total_bytes,
                "free_bytes": u.free_bytes,
                "total_inodes": u.total_inodes,
                "free_inodes": u.free_inodes,
            }
        )
        problems += low_space(u, settings.min_free, settings.min_free_inodes)
        if target.run is not None and path == target.run.path:
            fc = forecast(target, u.free_bytes)
            if fc is not None:
                details.append(fc.sentence())
                data["forecast"] = vars(fc)
                horizon = settings.forecast / 3600
                if settings.forecast and fc.hours_left is not None and fc.hours_left < horizon:
                    problems.append(
                        f"{path}: {fc.sentence()}, within the forecast horizon of {format_human(settings.forecast)}"
                    )
    if problems:
        return CheckResult(
            "disk",
            target.name,
            True,
            problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
            problems[1:] + details,
            data,
        )
    return CheckResult("disk", target.name, False, f"{len(seen)} filesystem(s) above their thresholds", details, data)


def main(argv: list[str] | None = None) -> int:
    return check_main("disk", check, "Free bytes and inodes, and a checkpoint forecast.", argv)


if __name__ == "__main__":
    sys.exit(main())
