"""Every read jobgen.slurm makes, fed what Slurm printed for it on the dev cluster, on each series
jobgen is tested on: 22.05 (Debian bookworm's) and 24.11 (``cluster up --slurm 24.11``). One
scenario, captured by tests/scripts/capture_slurm.sh into tests/unit/slurm_captured/<series>/ with
jobgen's own formats: an array of 3 (%1) whose first task runs a named step and whose comment
holds '|', a job held by a dependency on it whose name holds '|', and a job that exited 3. Both
series must read the same.

With '|' as the separator (--parsable2's own), the held job's sacct line read as name "dep name",
state "bar", exit code "RUNNING" (the name sat in the middle); the separator is now ASCII's unit
separator and the free text comes last.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobgen.base.durations import parse_slurm_limit
from jobgen.launch.preflight import _gres_count
from jobgen.slurm.client import (
    accounting_enabled,
    allocated_tres,
    job_record,
    parse_config,
    parse_my_jobs,
    parse_named_jobs,
    parse_node_states,
    parse_records,
    parse_sacct,
    parse_seconds,
    parse_squeue,
    parse_steps,
    parse_version,
    parse_words,
)

CAPTURED = Path(__file__).parent / "slurm_captured"
SERIES = sorted(p.name for p in CAPTURED.iterdir() if p.is_dir())


@pytest.fixture(params=SERIES)
def series(request) -> str:
    return request.param


def captured(series: str, name: str) -> str:
    return (CAPTURED / series / name).read_text()


def test_both_series_were_captured():
    assert SERIES == ["22.05", "24.11"]


def test_the_version(series):
    assert parse_version(captured(series, "sbatch_version.txt"))[:2] == tuple(map(int, series.split(".")))


def test_the_queue_one_line_per_array_task(series):
    rows = parse_squeue(captured(series, "squeue_queue.txt"))
    assert [(r.job_id, r.array_job_id, r.array_task, r.state, r.reason, r.nodes, r.name) for r in rows] == [
        (1, 1, "2", "PENDING", "JobArrayTaskLimit", "", "arr"),
        (1, 1, "3", "PENDING", "JobArrayTaskLimit", "", "arr"),
        (2, 2, "N/A", "PENDING", "Dependency", "", "dep name|bar"),
        (4, 1, "1", "RUNNING", "None", "node1", "arr"),
    ]
    assert [r.slurm_id for r in rows] == ["1_2", "1_3", "2", "1_1"]
    assert rows[3].start is not None and rows[3].time_limit == "3:00"
    assert all(r.start is None for r in rows[:3])


def test_a_tasks_steps_and_an_arrays_pending_tasks(series):
    assert parse_steps(captured(series, "squeue_steps.txt")) == {"1_1.0": "jobgen-launch-1", "1_1.batch": "batch"}
    assert parse_words(captured(series, "squeue_pending.txt")) == ["1_2", "1_3"]


def test_this_users_jobs_with_names_and_comments_that_hold_a_bar(series):
    mine = [
        (name, job.job_id, job.state, job.comment) for name, job in parse_my_jobs(captured(series, "squeue_mine.txt"))
    ]
    # Array tasks (1_1, and the pending rest 1_[2-3%1]) are left out: the chains looked for are single jobs.
    assert mine == [("dep name|bar", 2, "PENDING", "")]
    # By name (a watchdog chain's): an array's tasks are no chain.
    assert parse_named_jobs(captured(series, "squeue_named.txt")) == []


def test_accounting_of_ended_jobs(series):
    records = parse_sacct(captured(series, "sacct.txt"))
    rows = [(r.job_id, r.array_job_id, r.array_task, r.name, r.state, r.exit_code, r.comment) for r in records]
    # Steps' lines and the array's never-started rest (1_[2-3%1]) are not jobs of their own.
    assert rows == [
        (2, 2, "N/A", "dep name|bar", "CANCELLED", "0:0", ""),
        (3, 3, "N/A", "fail", "FAILED", "3:0", ""),
        (4, 1, "1", "arr", "CANCELLED", "0:0", "jobgen: task 1|done"),
    ]
    by_id = {r.job_id: r for r in records}
    assert by_id[3].time_limit == 60 and by_id[4].time_limit == 180 and by_id[4].nodes == "node1"
    assert by_id[4].start is not None and by_id[4].end >= by_id[4].start


def test_a_jobs_record_and_what_it_holds(series):
    records = parse_records(captured(series, "scontrol_job.txt"))
    jobs = [job_record(r) for r in records]
    assert [(j.job_id, j.array_task, j.state) for j in jobs if j is not None] == [(4, "1", "RUNNING")]
    (running,) = [r for r in records if r.get("JobState") == "RUNNING"]
    assert "cpu=1" in allocated_tres(running) and "node=1" in allocated_tres(running)
    assert job_record(running).comment == "jobgen: task 1|done"


def test_nodes_partitions_and_config(series):
    nodes = {r["NodeName"]: r for r in parse_records(captured(series, "scontrol_nodes.txt"))}
    assert {n: (_gres_count(r.get("Gres", ""), "gpu"), r["CPUTot"]) for n, r in nodes.items()} == {
        "node1": (2, "4"),
        "node2": (1, "4"),
    }
    assert nodes["node1"]["NodeAddr"] == "10.213.47.11" and nodes["node1"]["Version"].startswith(series)
    parts = {r["PartitionName"]: r for r in parse_records(captured(series, "scontrol_partitions.txt"))}
    assert parts["debug"]["Default"] == "YES" and parse_slurm_limit(parts["short"]["MaxTime"]) == 300
    conf = parse_config(captured(series, "scontrol_config.txt"))
    assert accounting_enabled(conf) and parse_seconds(conf["SlurmdTimeout"]) == 20


def test_node_states_as_sinfo_lists_them(series):
    # Each node once, though it is in two partitions (debug and short); node1 runs the array's task.
    assert parse_node_states(captured(series, "sinfo_nodes.txt")) == {"node1": "mix", "node2": "idle"}
