"""`jobgen status` without a cluster: the run's state as a pure function of what was read
(jobgen.report.status.decide_state), the one table of Slurm states, the watchdogs' alerts handed in
by the composition root, and Slurm being unreachable as data, not as a note to match."""

from __future__ import annotations

import json

import pytest

from helpers import jobgen
from jobgen.report.status import decide_state, run_status
from jobgen.slurm import client as slurm

NONE: set[str] = set()


def state(states=NONE, *, done=False, failed=False, doctor_ok=None, switches=NONE) -> str:
    return decide_state(set(states), done=done, failed=failed, doctor_ok=doctor_ok, switches=set(switches))


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # a task has started: running, whatever else is recorded
        ({"states": {"RUNNING"}}, "running"),
        ({"states": {"CONFIGURING"}}, "running"),
        ({"states": {"COMPLETING", "FAILED"}, "done": True, "failed": True, "switches": {"kill"}}, "running"),
        # queued, and no failure that every task would repeat: pending
        ({"states": {"PENDING"}}, "pending"),
        ({"states": {"REQUEUED"}, "switches": {"kill"}}, "pending"),
        ({"states": {"SUSPENDED"}}, "pending"),
        ({"states": {"PENDING"}, "failed": True}, "failed"),  # the queued rest will leave at once
        # Issue 47: a run finished in task 1 is finished, not pending, while tasks 2 and 3 are still queued.
        ({"states": {"PENDING"}, "done": True}, "finished"),
        ({"states": {"SUSPENDED"}, "done": True}, "finished"),
        # the done marker
        ({"done": True}, "finished"),
        ({"states": {"FAILED"}, "done": True, "switches": {"abort"}}, "finished"),
        ({"states": {"PENDING"}, "done": True, "failed": True}, "finished"),
        # the failed marker
        ({"failed": True}, "failed"),
        ({"failed": True, "doctor_ok": True, "switches": {"kill"}}, "failed"),
        # a doctor's verdict
        ({"doctor_ok": True}, "finished"),
        ({"doctor_ok": False}, "failed"),
        ({"states": {"FAILED"}, "doctor_ok": True, "switches": {"abort"}}, "finished"),
        # stopped on purpose
        ({"switches": {"kill"}}, "stopped"),
        ({"switches": {"abort"}}, "stopped"),
        ({"states": {"NODE_FAIL"}, "switches": {"kill"}}, "stopped"),
        ({"switches": {"save"}}, "unknown"),  # save is not a stop
        # a task failed
        ({"states": {"FAILED"}}, "failed"),
        ({"states": {"NODE_FAIL", "COMPLETED"}}, "failed"),
        ({"states": {"OUT_OF_MEMORY"}}, "failed"),
        ({"states": {"BOOT_FAIL"}}, "failed"),
        # tasks known, none of the above: stopped (time limit, cancel, ended and forgotten)
        ({"states": {"TIMEOUT"}}, "stopped"),
        ({"states": {"CANCELLED", "COMPLETED"}}, "stopped"),
        ({"states": {"ENDED"}}, "stopped"),
        ({"states": {"COMPLETED"}, "switches": {"save"}}, "stopped"),
        # nothing known
        ({}, "unknown"),
    ],
)
def test_decide_state_table(kwargs, expected):
    assert state(**kwargs) == expected


def test_one_table_of_slurm_states():
    """The sets are consistent with each other; everything that decides by them reads them here."""
    assert slurm.JOB_PENDING | slurm.JOB_STARTED | slurm.JOB_RUNNING <= slurm.JOB_ACTIVE
    assert slurm.JOB_RUNNING <= slurm.JOB_STARTED and not slurm.JOB_PENDING & slurm.JOB_STARTED
    assert not slurm.JOB_FAILED & slurm.JOB_ACTIVE
    assert "DependencyNeverSatisfied" in slurm.REASONS_NEVER_CLEAR and "JobHeldAdmin" in slurm.REASONS_NEVER_CLEAR
    assert {"DOWN", "DRAIN", "NOT_RESPONDING"} <= slurm.NODE_UNUSABLE and "IDLE" not in slurm.NODE_UNUSABLE
    for name in (
        "JOB_ACTIVE",
        "JOB_PENDING",
        "JOB_STARTED",
        "JOB_RUNNING",
        "JOB_FAILED",
        "NODE_UNUSABLE",
        "REASONS_NEVER_CLEAR",
    ):
        assert isinstance(getattr(slurm, name), frozenset), name


def _alert_state(run) -> str:
    """An active alert of the run's `running` watchdog, as watchdogs.notify records it."""
    home = run.load_spec().runs_root / ".watchdogs"
    (home / "state").mkdir(parents=True)
    (home / "state" / "stat.running.json").write_text(
        json.dumps({"status": "alert", "since": 0, "check": "running", "target": "stat", "summary": "nothing queued"})
    )
    return "watchdog running: nothing queued (since "


def test_watchdog_alerts_come_from_the_composition_root(run):
    from watchdogs.notify import run_alerts

    assert not any(w.startswith("watchdog ") for w in run_status(run).warnings)
    assert not run_alerts(run.load_spec())  # no watchdog home yet
    expected = _alert_state(run)
    assert not any(w.startswith("watchdog ") for w in run_status(run).warnings)
    assert [w for w in run_status(run, run_alerts).warnings if w.startswith(expected)]
    assert [w for w in run_status(run, lambda spec: ["x: y"]).warnings if w == "watchdog x: y"]
    # `jobgen status` (jobgen/cli/main.py) hands them in, as before
    proc = jobgen("status", str(run.path), check=True)
    assert f"WARNING  {expected}" in proc.stdout, proc.stdout
    view = json.loads(jobgen("status", str(run.path), "--json", check=True).stdout)
    assert [w for w in view["warnings"] if w.startswith(expected)], view


def test_unreachable_slurm_is_a_field_not_a_note_to_match(run, monkeypatch: pytest.MonkeyPatch):
    from watchdogs.running import check
    from watchdogs.target import Target

    run.record_job({"job_id": 4242})

    def unreachable(job_ids=None):
        raise slurm.SlurmUnavailable(
            ["squeue"], 1, "squeue: error: Unable to contact slurm controller (connect failure)"
        )

    monkeypatch.setattr(slurm, "queue", unreachable)
    status = run_status(run)
    note = (
        "Slurm not reachable (squeue: error: Unable to contact slurm controller (connect failure)): "
        "showing what the run directory records"
    )
    assert status.slurm_unreachable == note and status.notes == [note] and status.state == "unknown"
    assert "slurm_unreachable" not in status.to_json() and status.to_json()["notes"] == [note]
    spec = run.load_spec()
    result = check(Target(settings=spec.run.watchdogs, run=run, spec=spec))
    assert result.alert and result.summary == f"could not ask Slurm: {note}", result

    # Slurm answers and has forgotten the job (MinJobAge): nothing is unreachable.
    monkeypatch.setattr(slurm, "queue", lambda job_ids=None: [])
    monkeypatch.setattr(slurm, "show_job", lambda job_id: [])
    monkeypatch.setattr(slurm, "config", lambda: {})  # no KillWait: no kill-window warning
    status = run_status(run)
    assert status.slurm_unreachable is None and status.state == "stopped", status  # ENDED
    result = check(Target(settings=spec.run.watchdogs, run=run, spec=spec))
    assert result.alert and result.summary.startswith("no job running or pending"), result
