"""Hang check: a RUNNING job whose metrics and log stopped moving.

    python -m watchdogs.hang --run RUN [--stale-after 30m]
    jobgen watchdog run hang RUN

A rank stuck in a read with no timeout, a deadlocked collective or a wedged
filesystem leaves a job that Slurm sees as RUNNING for the rest of its time limit.
Progress is the newest of: ``metrics.jsonl``, ``tasks.jsonl`` and the job's batch
log (and never earlier than the job's start, so a job still loading its model is not
"hung"). Before alerting, every rank's Python stack is dumped with py-spy through a
short ``srun --overlap`` step into ``<run>/hangs/<time>-job<J>.txt``; the alert
names that file, so the person who wakes up sees where it hung.

This module owns the hang verdict and the stack dump; the batch log's name is the run
directory's layout (jobgen.runs.rundir.RunDir.batch_log).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from jobgen.base.atomic import write_text_atomic
from jobgen.base.durations import format_human
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm
from watchdogs.base import RunningJob, running_jobs
from watchdogs.base import main as check_main
from watchdogs.target import CheckResult, Target


def last_progress(run_dir: Path, job: RunningJob, job_name: str) -> tuple[float | None, str]:
    candidates = [run_dir / "metrics.jsonl", run_dir / "tasks.jsonl", RunDir(run_dir).batch_log(job_name, job.job_id)]
    best, what = None, "nothing written yet"
    for path in candidates:
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if best is None or mtime > best:
            best, what = mtime, path.name
    if job.start_time is not None and (best is None or job.start_time > best):
        best, what = job.start_time, "job start"
    return best, what


def dump_stacks(run_dir: Path, job: RunningJob) -> tuple[Path, bool]:
    """py-spy every rank of the job; returns the file written and whether srun worked."""
    command = [sys.executable, "-m", "watchdogs.probe", "stacks", str(job.job_id)]
    try:
        proc = slurm.run_in_job(job.job_id, len(job.nodes) or 1, command)
        text, ok = proc.stdout + (f"\n--- stderr\n{proc.stderr}" if proc.stderr.strip() else ""), proc.returncode == 0
    except slurm.SlurmError as exc:
        text, ok = f"srun failed: {exc}\n", False
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = RunDir(run_dir).hang_stacks(stamp, job.job_id)
    target.parent.mkdir(exist_ok=True)
    header = f"# stacks of job {job.job_id} on {','.join(job.nodes)}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
    write_text_atomic(target, header + text)
    return target, ok


def check(target: Target) -> CheckResult:
    assert target.run is not None and target.spec is not None
    settings = target.settings.hang
    jobs = running_jobs(target.run)
    if not jobs:
        return CheckResult("hang", target.name, False, "no job running: nothing to hang")
    now = time.time()
    alerts, details, data = [], [], {"jobs": []}
    for job in jobs:
        when, what = last_progress(target.run.path, job, target.spec.run.job.name)
        age = now - when if when is not None else None
        data["jobs"].append({"job_id": job.job_id, "nodes": job.nodes, "seconds_since_progress": age, "source": what})
        if age is None or age < settings.stale_after:
            details.append(f"job {job.job_id}: last progress {format_human(round(age or 0))} ago ({what})")
            continue
        line = (
            f"job {job.job_id} RUNNING on {','.join(job.nodes)} but no progress for {format_human(round(age))} "
            f"(last: {what}; threshold {format_human(settings.stale_after)})"
        )
        if settings.stack_dump:
            path, ok = dump_stacks(target.run.path, job)
            line += f"; stacks of every rank in {path}" + ("" if ok else " (the srun step failed: see the file)")
            data["jobs"][-1]["stacks"] = str(path)
        alerts.append(line)
    if alerts:
        return CheckResult("hang", target.name, True, alerts[0], alerts[1:] + details, data)
    return CheckResult("hang", target.name, False, "; ".join(details), [], data)


def main(argv: list[str] | None = None) -> int:
    return check_main("hang", check, "A RUNNING job whose metrics and log stopped moving.", argv)


if __name__ == "__main__":
    sys.exit(main())
