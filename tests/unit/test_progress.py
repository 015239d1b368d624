"""jobgen.base.progress and what `submit --wait` says while it waits (tests/cluster/test_slurm_status.py
runs `jobgen submit --wait` on the dev cluster)."""

from __future__ import annotations

import io

from jobgen.base.progress import Progress
from jobgen.report.first_step import where_it_stands
from jobgen.report.task_table import TaskStatus
from jobgen.slurm import client as slurm


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_with_rate_and_eta_redrawn_in_place_on_a_terminal():
    out, clock = Terminal(), Clock()
    bar = Progress("export", total=1e9, unit="B", stream=out, clock=clock)
    clock.now += 10
    bar.update(250e6)
    assert out.getvalue() == "\r" + bar.line()
    assert "250.0 MB / 1.0 GB" in bar.line() and "25.0 MB/s" in bar.line() and "ETA 30s" in bar.line()
    clock.now += 0.05
    bar.advance(1e6)  # within REDRAW_SECONDS: not drawn again
    assert out.getvalue().count("\r") == 1
    clock.now += 30
    bar.update(1e9)
    bar.close()
    assert out.getvalue().endswith("done in 40s\n") and out.getvalue().count("\r") == 3


def test_nothing_at_all_off_a_terminal():
    out = io.StringIO()
    bar = Progress("export", total=10, stream=out)
    bar.advance(5)
    bar.close()
    assert out.getvalue() == ""


def test_where_a_submission_stands():
    line = "9\x1f9\x1f1\x1fPENDING\x1fPriority\x1f0:00\x1f10:00\x1f\x1f2026-11-22T15:10:00\x1fdemo\n"
    queue = slurm.parse_squeue(line)
    pending = TaskStatus(9, 9, "1", "PENDING", reason="Priority")
    now = slurm.parse_time("2026-11-22T15:07:00")
    assert where_it_stands([pending], queue, 9, now) == "9_1 pending (Priority); Slurm expects it to start in 3m00s"
    # Started 12 s ago; the run's earlier task took 20 s from its start to its first step.
    earlier = TaskStatus(7, 5, "1", "COMPLETED", seconds_to_first_step=20.0)
    running = TaskStatus(10, 9, "1", "RUNNING", nodes="node[1-2]", start_time=now - 12)
    assert where_it_stands([earlier, running], [], 9, now) == (
        "9_1 running on node[1-2] for 12s; earlier tasks took 20s to their first step (ETA 8s)"
    )
