"""`jobgen status RUN --watch` as the quickstart shows it, without a cluster: the step is never
behind the newest checkpoint, each task has one state, and the final block is printed once.
Slurm's answers are captured text fed to the parsers; the run directory is built by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import REPO
from jobgen.report import status as status_module
from jobgen.report.status import run_status, watch_run
from jobgen.slurm import client as slurm
from run_dirs import training_run_at_step_25


class Polled(Exception):
    """The watch went on polling (slept) where the run should have ended."""


@pytest.fixture
def train_run(tmp_path: Path):
    return training_run_at_step_25(tmp_path)


def _slurm_says(monkeypatch: pytest.MonkeyPatch, squeue: str) -> None:
    """squeue prints ``squeue``; Slurm remembers nothing else and has no kill window."""
    monkeypatch.setattr(slurm, "queue", lambda job_ids=None: slurm.parse_squeue(squeue))
    monkeypatch.setattr(slurm, "config", lambda: {})
    monkeypatch.setattr(slurm, "show_job", lambda job_id: [])


def _watch(run, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], object]:
    """The lines one poll of the watch prints (without their clock), and its final status
    (None when the watch would poll again: the run has not ended)."""

    def no_sleep(seconds):
        raise Polled

    monkeypatch.setattr(status_module.time, "sleep", no_sleep)
    printed: list[str] = []
    try:
        final = watch_run(run, printed.append)
    except Polled:
        final = None
    return [line.split(" ", 1)[1] for line in printed], final


def _saved(run, step: int) -> None:
    (run.checkpoints / f"step-{step:08d}").mkdir(parents=True)


def _ended(run, code: int, reason: str) -> None:
    """The batch script's end record of 17_1's first attempt (job 18): exit ``code``."""
    record = {"job_id": "18", "array_job_id": "17", "array_task": "1", "restart": 0, "nodes": "node1",
              "job_start": 1000.0, "end": 1060.0, "exit_code": code, "slurm_exit": 0, "reason": reason}  # fmt: skip
    run.task_record(18, 0).write_text(json.dumps(record))


def test_the_step_is_never_behind_the_newest_checkpoint(train_run, monkeypatch):
    """Step 27 is saved, the last metrics line says 25: the step is 27, the loss still 25's."""
    _saved(train_run, 20)
    _saved(train_run, 27)
    _slurm_says(
        monkeypatch, "18\x1f17\x1f1\x1fRUNNING\x1fNone\x1f0:40\x1f5:00\x1fnode1\x1f2026-11-22T14:04:10\x1fstat\n"
    )
    status = run_status(train_run)
    assert (status.step, status.logged_step, status.saved_step) == (27, 25, 27), status
    view = status.to_json()
    assert view["step"] == 27 and view["loss"] == pytest.approx(2.75), view
    assert status.eta_seconds == pytest.approx(33.0)  # 60 - 27 steps of 1 s
    lines, final = _watch(train_run, monkeypatch)
    assert final is None and lines == ["running step 27/60 (logged 25, saved 27)  17_1:RUNNING"], lines

    # Nothing saved since the last line: the logged step alone, as before.
    for path in train_run.checkpoints.iterdir():
        path.rmdir()
    assert (run_status(train_run).step, run_status(train_run).saved_step) == (25, None)


def test_a_task_ending_has_one_state_in_the_watch_line(train_run, monkeypatch):
    """The batch script recorded 17_1's end (COMPLETED) while squeue still lists it as
    COMPLETING (epilog), or still lists how it ended: one state, the final one, and the
    finished run ends the watch at once."""
    _ended(train_run, 0, "max_steps reached")
    train_run.done_marker.write_text("")
    _saved(train_run, 60)
    for state in ("COMPLETING", "COMPLETED"):
        _slurm_says(
            monkeypatch, f"18\x1f17\x1f1\x1f{state}\x1fNone\x1f1:00\x1f5:00\x1fnode1\x1f2026-11-22T14:04:10\x1fstat\n"
        )
        lines, final = _watch(train_run, monkeypatch)
        assert lines == ["finished step 60/60 (logged 25, saved 60)  17_1:COMPLETED"], (state, lines)
        assert [(t.slurm_id, t.restart, t.state) for t in final.tasks] == [("17_1", 0, "COMPLETED")], state

    # Slurm's word on how it ended wins over the script's guess, as with scontrol's memory.
    _slurm_says(
        monkeypatch, "18\x1f17\x1f1\x1fTIMEOUT\x1fTimeLimit\x1f5:00\x1f5:00\x1fnode1\x1f2026-11-22T14:04:10\x1fstat\n"
    )
    assert [(t.slurm_id, t.state) for t in run_status(train_run).tasks] == [("17_1", "TIMEOUT")]


def test_a_requeued_task_shows_its_latest_attempt_in_the_watch_line(train_run, monkeypatch):
    """Attempt 0 ended (preempted), attempt 1 waits: the status block has both rows, the watch
    line the task once, as it is now."""
    _ended(train_run, 12, "SIGTERM")
    _slurm_says(monkeypatch, "18\x1f17\x1f1\x1fPENDING\x1fBeginTime\x1f0:00\x1f5:00\x1f\x1fN/A\x1fstat\n")
    status = run_status(train_run)
    rows = [(t.slurm_id, t.restart, t.state) for t in status.tasks]
    assert rows == [("17_1", 0, "COMPLETED"), ("17_1", 1, "PENDING")], rows
    assert status_module.watch_line(status) == "pending step 25/60  17_1:PENDING"


def test_the_quickstart_prints_the_final_block_once():
    """`jobgen status RUN --watch` ends with the run's status block: the quickstart does not
    follow it with `jobgen status RUN`, which would print the same block again."""
    script = (REPO / "examples" / "quickstart.sh").read_text()
    commands = [line.strip() for line in script.splitlines() if re.match(r'\s*"\$jobgen" ', line)]
    watches = [i for i, c in enumerate(commands) if re.match(r'"\$jobgen" status "\$run" --watch\b', c)]
    assert watches, commands
    for i in watches:
        assert i + 1 == len(commands) or commands[i + 1] != '"$jobgen" status "$run"', commands[i : i + 2]
