"""jobgen.report.logs on a run directory laid out as the batch script, torchrun and the trainer leave
it (the dev-cluster test in tests/cluster/test_slurm_status.py follows a live 2-node job)."""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest

from helpers import jobgen
from jobgen.report import logs as logs_module
from jobgen.report.logs import Filters, find_sources, follow, merged, tail
from jobgen.runs.rundir import RunDir
from run_dirs import JOB_HEAD, recorded_run


def lay_out(tmp_path, run: RunDir | None = None) -> RunDir:
    run = run or RunDir(tmp_path / "demo")
    run.logs.mkdir(parents=True, exist_ok=True)
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


def command_layout(tmp_path, *, identities: bool = True) -> RunDir:
    """A `program = "command"` job (a Hugging Face example script) on 2 nodes x 2 processes as
    torchrun lays out --log-dir=logs/ranks/<job>/<node>: no rank map (the program writes
    none), the script's own logging format, and each rank's record of itself
    (RunDir.rank_identity). The rendezvous made node2 group rank 0: names say nothing."""
    run = RunDir(tmp_path / "demo")
    run.logs.mkdir(parents=True)
    run.task_record(7, 0).write_text(
        json.dumps({"job_id": "7", "array_job_id": "5", "array_task": "2", "nodes": "node[1-2]"})
    )
    for node, group, seconds in (("node1", 1, ["09", "20"]), ("node2", 0, ["10", "15"])):
        for local in (0, 1):
            launch = run.rank_logs(7, node) / "7_x1y2" / "attempt_0" / str(local)
            launch.mkdir(parents=True)
            rank = 2 * group + local
            lines = [
                f"11/22/2026 10:00:{s} - WARNING - __main__ - line {i} of {node}/{local}" for i, s in enumerate(seconds)
            ]
            (launch / "stderr.log").write_text("\n".join(lines) + "\n")
            (launch / "stdout.log").write_text("")
            if identities:
                run.rank_identity(7, node, 0, local).write_text(json.dumps({"rank": rank, "group_rank": group}))
    return run


def test_a_command_programs_ranks_by_node_and_global_rank_in_time_order(tmp_path):
    run = command_layout(tmp_path)
    out = lines(run)
    assert [line.split(" | ")[0] for line in out[:4]] == [
        "5_2 node1 r2",
        "5_2 node1 r3",
        "5_2 node2 r0",
        "5_2 node2 r1",
    ]
    stamps = [line.split(" | ")[1][:19] for line in out]
    assert stamps == sorted(stamps) and len(out) == 8
    assert [line.split(" | ")[1] for line in lines(run, rank=0)] == [
        "11/22/2026 10:00:10 - WARNING - __main__ - line 0 of node2/0",
        "11/22/2026 10:00:15 - WARNING - __main__ - line 1 of node2/0",
    ]


def test_without_the_ranks_own_records_a_node_keeps_its_local_ranks_apart(tmp_path):
    from jobgen.report.logs import unknown_ranks

    run = command_layout(tmp_path, identities=False)
    assert {line.split(" | ")[0] for line in lines(run)} == {
        "5_2 node1 local0", "5_2 node1 local1", "5_2 node2 local0", "5_2 node2 local1"
    }  # fmt: skip
    assert lines(run, rank=0) == []
    assert unknown_ranks(find_sources(run, "demo", Filters())) == ["5_2 node1", "5_2 node2"]
    # One node: its group rank is 0, so the local rank is the global one.
    run.task_record(7, 0).write_text(
        json.dumps({"job_id": "7", "array_job_id": "5", "array_task": "2", "nodes": "node1"})
    )
    assert {line.split(" | ")[0] for line in lines(run, rank=1, node="node1")} == {"5_2 node1 r1"}


# ---------------------------------------------------------------- the last lines, read from the ends


def random_layout(tmp_path, rng: random.Random) -> RunDir:
    """A run of 1-3 jobs on two nodes with random logs: stamped and unstamped lines (an
    unstamped one takes its predecessor's time), torchrun's teed copies in the batch logs,
    lines as long as a read block, a last line without its newline; each file's time is
    its last stamp's, as a writer on that clock leaves it."""
    run = RunDir(tmp_path / "demo")
    run.logs.mkdir(parents=True)
    clock = 1_795_000_000.0  # 2026-11-19: stamps of one run, days long
    for job in range(7, 7 + rng.randint(1, 3)):
        files = [run.batch_log("demo", job)]
        for node in ("node1", "node2"):
            launch = run.rank_logs(job, node) / f"{job}_a" / "attempt_0" / "0"
            launch.mkdir(parents=True)
            files += [launch / "stdout.log", launch / "stderr.log"]
        times = dict.fromkeys(files, clock)
        texts: dict[Path, list[str]] = {f: [] for f in files}
        for _ in range(rng.choice([0, 5, 300, 1500])):
            path = rng.choice(files)
            times[path] += rng.choice([0.0, 0.5, 30.0, 4000.0])
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(times[path]))
            kind = rng.random()
            if kind < 0.15:
                line = "  unstamped traceback line"
            elif kind < 0.25 and path == files[0]:
                line = f"[default0]:{stamp} trainer[0] INFO a teed copy"
            elif kind < 0.27:
                line = f"{stamp} trainer[0] INFO {'x' * rng.choice([70_000, 140_000])}"
            else:
                line = f"{stamp} trainer[0] INFO step {len(texts[path])}"
            texts[path].append(line)
        for path, lines_of in texts.items():
            ending = rng.choice(["\n", "", f"\n{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(times[path]))} half"])
            path.write_text("\n".join(lines_of) + (ending if lines_of else ""))
            os.utime(path, (times[path], times[path]))
        clock = max(times.values()) + 60
    return run


@pytest.mark.parametrize("seed", range(16))
def test_the_tail_read_from_the_ends_equals_the_last_lines_of_the_whole_stream(tmp_path, seed):
    rng = random.Random(seed)
    run = random_layout(tmp_path, rng)
    for filters in (Filters(), Filters(grep=re.compile("step [0-9]*7$")), Filters(node="node2")):
        everything = list(merged(find_sources(run, "demo", filters), filters))
        for count in (1, 3, 50, 1000):
            got = tail(find_sources(run, "demo", filters), filters, count)
            assert got.lines == everything[-count:], (seed, filters, count)
            assert got.left_out == (len(everything) > count), (seed, filters, count)


def test_a_tail_reads_from_the_ends_and_skips_files_older_than_its_lines(tmp_path, monkeypatch):
    """A week of one rank's lines (40 MB) and 200 older tasks' logs: the last 10 lines read
    a few blocks of the newest file and open no file last written before them."""
    run = RunDir(tmp_path / "demo")
    run.logs.mkdir(parents=True)
    day = 86_400.0
    start = 1_795_000_000.0
    for job in range(1, 201):
        path = run.batch_log("demo", job)
        path.write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(start + job))} jobgen: job {job}\n")
        os.utime(path, (start + job, start + job))
    newest = run.batch_log("demo", 201)
    line = "{} trainer[0] INFO step {} loss 1.0 " + "x" * 60 + "\n"
    with newest.open("w") as fh:
        for step in range(500_000):
            at = start + 7 * day * step / 500_000
            fh.write(line.format(time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)), step))
    opened: list[Path] = []
    real_open = logs_module.open_regular
    monkeypatch.setattr(logs_module, "open_regular", lambda p: opened.append(p) or real_open(p))
    got = tail(find_sources(run, "demo", Filters()), Filters(), 10)
    assert [x.split(" step ")[1].split()[0] for x in got.lines] == [str(s) for s in range(499_990, 500_000)]
    assert got.left_out and opened == [newest], opened


def test_jobgen_logs_shows_the_last_lines_and_says_what_it_left_out(tmp_path):
    run = lay_out(tmp_path, recorded_run(tmp_path, JOB_HEAD.replace('"stat"', '"demo"') + 'program = "doctor"\n'))
    out = jobgen("logs", str(run.path), "--tail", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == lines(run)[-3:]
    assert "the last 3 lines; --tail N for more, --all for every line" in out.stderr
    for every in (["--all"], ["--tail", "10"], []):
        out = jobgen("logs", str(run.path), *every)
        assert out.stdout.splitlines() == lines(run) and out.stderr == "", (every, out.stderr)
    refused = jobgen("logs", str(run.path), "--all", "--tail", "3")
    assert refused.returncode == 2 and "--all and --tail" in refused.stderr


def test_a_task_the_logs_do_not_know_is_named_with_the_tasks_they_do(tmp_path):
    """Issue 46: `jobgen logs RUN --task 1` of a run whose tasks are named otherwise (a --local
    run's task is its job id, as status shows it) printed nothing and exited 0."""
    run = lay_out(tmp_path, recorded_run(tmp_path, JOB_HEAD.replace('"stat"', '"demo"') + 'program = "doctor"\n'))
    missing = jobgen("logs", str(run.path), "--task", "3")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip() == f"jobgen logs: no task '3' in {run.path} (its tasks: 5_2)"
    for name in ("2", "5_2", "7"):  # the array index, Slurm's name and the job id all find it
        found = jobgen("logs", str(run.path), "--task", name, "--all")
        assert found.returncode == 0 and found.stdout.splitlines() == lines(run), (name, found.stderr)


def test_a_local_runs_task_is_found_by_the_name_and_index_status_shows(tmp_path):
    """Issue 46: a ``--local`` run's task (no array job id, task 1) is shown by status as
    JOBID_1; `jobgen logs RUN --task 1` found nothing (only the bare job id matched)."""
    run = lay_out(tmp_path, recorded_run(tmp_path, JOB_HEAD.replace('"stat"', '"demo"') + 'program = "doctor"\n'))
    run.task_record(7, 0).write_text(json.dumps({"job_id": "7", "array_job_id": "", "array_task": "1"}))
    for name in ("1", "7_1", "7"):
        found = jobgen("logs", str(run.path), "--task", name, "--all")
        assert found.returncode == 0 and found.stdout.splitlines() == lines(run), (name, found.stderr)
        assert found.stdout.startswith("7_1 | ")
