"""When the lines of ``metrics.jsonl`` reach the disk (jobgen.runtime.records.MetricsWriter): every
line is written and closed at once (another node's reader sees it), but fsynced at most every
METRICS_SYNC_SECONDS, since an fsync per step lay on the step loop's critical path; the steps'
last lines are fsynced before the task's own record (tasks.jsonl, fsynced at every line)."""

from __future__ import annotations

import os
from pathlib import Path

from jobgen.runtime import records
from jobgen.runtime.records import MetricsWriter


def test_step_lines_are_fsynced_at_most_every_few_seconds_and_before_the_task_record(tmp_path: Path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    clock = [1000.0]
    monkeypatch.setattr(records.os, "fsync", fsync)
    monkeypatch.setattr(records.time, "monotonic", lambda: clock[0])
    writer = MetricsWriter(tmp_path, enabled=True)
    for step in range(1, 11):  # 10 steps in 1 s: the first line is synced, the next 9 are not
        writer.log_step({"step": step, "loss": 1.0})
        clock[0] += 0.1
    assert synced == ["metrics.jsonl"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 10  # every line written at once
    clock[0] += records.METRICS_SYNC_SECONDS
    writer.log_step({"step": 11, "loss": 1.0})  # the period has passed: this one is synced
    writer.log_step({"step": 12, "loss": 1.0})
    assert synced == ["metrics.jsonl"] * 2
    writer.log_task({"event": "exit", "end_step": 12})  # step 12's line first, then the record
    assert synced == ["metrics.jsonl"] * 3 + ["tasks.jsonl"]
    writer.log_task({"event": "note"})  # nothing unsynced left in metrics.jsonl
    assert synced == ["metrics.jsonl"] * 3 + ["tasks.jsonl"] * 2
