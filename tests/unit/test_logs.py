"""jobgen.logs on a run directory laid out as the batch script, torchrun and the trainer leave
it (the dev-cluster test in tests/cluster/test_slurm_status.py follows a live 2-node job)."""

from __future__ import annotations

import json
import re
import threading
import time

from jobgen.logs import Filters, find_sources, follow, merged
from jobgen.rundir import RunDir


def lay_out(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "demo")
    run.logs.mkdir(parents=True)
    run.batch_log("demo", 7).write_text(
        "2026-11-22T10:00:00 jobgen: job 7 (array task 2) on node[1-2]\n"
        "[default0]:2026-11-22T10:00:09 trainer[0] INFO teed copy, shown from the rank's file\n"
        "2026-11-22T10:00:30 jobgen: program exited with status 0\n"
    )
    run.task_record(7, 0).write_text(json.dumps({"job_id": "7", "array_job_id": "5", "array_task": "2"}))
    for node, stamps in (("node1", ["10:00:09", "10:00:20"]), ("node2", ["10:00:10", "10:00:15"])):
        for local in (0, 1):
            launch = run.rank_logs(7, node) / "7_abc" / "attempt_0" / str(local)
            launch.mkdir(parents=True)
            rank = (0 if node == "node1" else 2) + local
            lines = [f"2026-11-22T{s} trainer[{rank}] WARNING line {i} of rank {rank}" for i, s in enumerate(stamps)]
            (launch / "stdout.log").write_text("\n".join(lines) + "\n")
            (launch / "stderr.log").write_text("")
    ranks = {"0": ("node1", 0), "1": ("node1", 1), "2": ("node2", 0), "3": ("node2", 1)}
    run.rank_map(7, 0).write_text(json.dumps({r: {"node": n, "local_rank": lr} for r, (n, lr) in ranks.items()}))
    return run


def lines(run, **filters) -> list[str]:
    f = Filters(**filters)
    return list(merged(find_sources(run, "demo", f), f))


def test_merged_by_time_prefixed_and_without_the_teed_copies(tmp_path):
    out = lines(lay_out(tmp_path))
    assert out[0] == "5_2 | 2026-11-22T10:00:00 jobgen: job 7 (array task 2) on node[1-2]"
    assert out[-1] == "5_2 | 2026-11-22T10:00:30 jobgen: program exited with status 0"
    assert not any("teed copy" in line for line in out)
    ranks = [line for line in out if "trainer[" in line]
    assert len(ranks) == 8
    assert ranks[:2] == [
        "5_2 node1 r0 | 2026-11-22T10:00:09 trainer[0] WARNING line 0 of rank 0",
        "5_2 node1 r1 | 2026-11-22T10:00:09 trainer[1] WARNING line 0 of rank 1",
    ]
    stamps = [re.search(r"T(\d\d:\d\d:\d\d)", line).group(1) for line in out]
    assert stamps == sorted(stamps)


def test_filters(tmp_path):
    run = lay_out(tmp_path)
    assert {line.split(" | ")[0] for line in lines(run, rank=3)} == {"5_2 node2 r3"}
    assert {line.split(" | ")[0] for line in lines(run, node="node1")} == {"5_2 node1 r0", "5_2 node1 r1"}
    for task in ("2", "5_2", "7"):
        assert len(lines(run, task=task)) == 10
    assert lines(run, task="3") == []
    assert [line.split(" | ")[1] for line in lines(run, grep=re.compile("line 1 of rank [02]"))] == [
        "2026-11-22T10:00:15 trainer[2] WARNING line 1 of rank 2",
        "2026-11-22T10:00:20 trainer[0] WARNING line 1 of rank 0",
    ]


def test_follow_prints_new_lines_and_new_sources_as_they_come(tmp_path):
    run = lay_out(tmp_path)
    seen: list[str] = []
    done = threading.Event()
    f = Filters()
    thread = threading.Thread(
        target=follow,
        args=(lambda: find_sources(run, "demo", f), f, seen.append),
        kwargs={"interval": 0.05, "until": done.is_set},
    )
    thread.start()
    try:
        time.sleep(0.3)
        assert len(seen) == 10
        with run.batch_log("demo", 7).open("a") as fh:
            fh.write("2026-11-22T10:00:31 jobgen: half a li")
            fh.flush()
            time.sleep(0.2)
            assert len(seen) == 10  # not before its newline
            fh.write("ne\n")
        run.batch_log("demo", 8).write_text("2026-11-22T10:01:00 jobgen: job 8 (array task 3) on node[1-2]\n")
        deadline = time.time() + 5
        while len(seen) < 12 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        thread.join(5)
    assert seen[10:] == [
        "5_2 | 2026-11-22T10:00:31 jobgen: half a line",
        "8 | 2026-11-22T10:01:00 jobgen: job 8 (array task 3) on node[1-2]",
    ]
