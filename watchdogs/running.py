"""Running check: the run has a job running or pending, or it has finished.

    python -m watchdogs.running --run RUN
    jobgen watchdog run running RUN

An array that ran out of tasks, a cancelled job, a dependency that can never be
met or a job held by an admin all leave a run that is neither finished nor going
anywhere; nobody notices until morning. A run stopped on purpose (kill or abort
switch, jobgen.runs.rundir.STARTUP_SWITCHES) is not an alert: the person who stopped it knows.

It decides from ``jobgen.report.status.run_status`` and the job states and pending reasons
of ``jobgen.slurm.client`` (``JOB_ACTIVE``, ``JOB_PENDING``, ``REASONS_NEVER_CLEAR``); when
Slurm cannot be asked, ``RunStatus.slurm_unreachable`` says so.
"""

from __future__ import annotations

import sys
from typing import Any

from jobgen.report.status import RunStatus, run_status
from jobgen.runs.rundir import STARTUP_SWITCHES
from jobgen.runs.sweep_runs import sweep_of
from jobgen.slurm import client as slurm
from watchdogs.base import main as check_main
from watchdogs.target import CheckResult, Target


def check(target: Target) -> CheckResult:
    assert target.run is not None
    status = run_status(target.run)
    step = f"step {status.step if status.step is not None else '-'}"
    if status.max_steps:
        step += f"/{status.max_steps}"
    data = {
        "state": status.state,
        "step": status.step,
        "max_steps": status.max_steps,
        "jobs": [f"{t.slurm_id}:{t.state}" for t in status.tasks],
    }
    queued = [t for t in status.tasks if t.state in slurm.JOB_ACTIVE]
    if status.slurm_unreachable:
        return CheckResult("running", target.name, True, f"could not ask Slurm: {status.slurm_unreachable}", [], data)
    # Pending for a reason that never clears: it will not start without a person.
    stuck = [t for t in queued if t.state in slurm.JOB_PENDING and (t.reason or "") in slurm.REASONS_NEVER_CLEAR]
    if stuck and len(stuck) == len(queued):
        t = stuck[0]
        return CheckResult(
            "running",
            target.name,
            True,
            f"task {t.slurm_id} is pending with reason {t.reason}: it will not start by itself ({step})",
            [f"inspect: scontrol show job {t.job_id}"],
            data,
        )
    if status.state in ("running", "pending"):
        running = [t for t in queued if t.state not in slurm.JOB_PENDING]
        pending = [t for t in queued if t.state in slurm.JOB_PENDING]
        parts = [f"{len(running)} running" if running else "", f"{len(pending)} pending" if pending else ""]
        jobs = ", ".join(f"{t.slurm_id} {t.state}" for t in queued)
        return CheckResult(
            "running", target.name, False, f"{' and '.join(p for p in parts if p)} ({jobs}); {step}", [], data
        )
    if status.state == "finished":
        return CheckResult("running", target.name, False, f"finished ({step})", [], data)
    if set(STARTUP_SWITCHES) & set(status.switches):
        return CheckResult(
            "running", target.name, False, f"stopped on purpose (switch {', '.join(status.switches)}), {step}", [], data
        )
    if not target.run.jobs() and sweep_of(target.run) is None:  # a sweep's point: the sweep's jobs
        return CheckResult("running", target.name, True, "never submitted: no job in jobs.json", [], data)
    return _ended(target, status, step, data)


def _ended(target: Target, status: RunStatus, step: str, data: dict[str, Any]) -> CheckResult:
    """The alert for a run with no job left that neither finished nor was stopped on purpose."""
    assert target.run is not None
    last = status.tasks[-1] if status.tasks else None
    ended = (
        f"last task {last.slurm_id} {last.state}" + (f" ({last.exit_reason})" if last and last.exit_reason else "")
        if last
        else "no job known"
    )
    spec_file = target.spec.spec_file if target.spec else None
    return CheckResult(
        "running",
        target.name,
        True,
        f"no job running or pending and the run has not finished ({step}; {ended})",
        [
            f"continue it: jobgen submit {spec_file or target.run.path / 'run.toml'}",
            f"details: jobgen status {target.run.path}",
        ],
        data,
    )


def main(argv: list[str] | None = None) -> int:
    return check_main("running", check, "The run has a job running or pending, unless it finished.", argv)


if __name__ == "__main__":
    sys.exit(main())
