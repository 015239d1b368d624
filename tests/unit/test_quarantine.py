"""Bad-node quarantine (jobgen.runs.quarantine) without a cluster: which nodes a failed task
blames, the file that keeps them, and what a submission and status make of it. The whole
chain (a node's ranks stopped on the dev cluster, its pending tasks kept off it, doctor
--clear releasing it) is tests/cluster/test_slurm_quarantine.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from jobgen.launch.submit import sbatch_options
from jobgen.runs import quarantine
from jobgen.runs.quarantine import RankEnd, silent_nodes
from jobgen.runs.rundir import RunDir

RANKS = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}


def _end(rank: int, waited: float) -> RankEnd:
    return RankEnd(rank, RANKS[rank], waited, "RuntimeError")


def test_the_node_whose_ranks_went_silent_while_others_timed_out_is_blamed():
    blamed = silent_nodes(RANKS, [_end(0, 31.0), _end(1, 30.5)], timeout_seconds=30)
    assert list(blamed) == ["node2"]
    assert blamed["node2"] == "its ranks 2,3 went silent while ranks 0,1 waited out the 30 s collective timeout"


@pytest.mark.parametrize(
    "ends",
    [
        pytest.param([_end(0, 2.0), _end(1, 1.5)], id="a-crash-in-the-code-is-no-node's-fault"),
        pytest.param([_end(0, 31.0), _end(1, 3.0), _end(2, 0.2), _end(3, 0.2)], id="every-rank-reported"),
        pytest.param([_end(0, 31.0), _end(2, 30.2)], id="every-node-has-a-silent-rank"),
        pytest.param([], id="nobody-reported"),
    ],
)
def test_nothing_is_blamed_without_a_timeout_and_a_silent_node(ends):
    assert silent_nodes(RANKS, ends, timeout_seconds=30) == {}


def test_one_silent_rank_blames_its_node_though_its_neighbours_timed_out():
    # One hung GPU: the other ranks of its node wait for it like everyone else.
    blamed = silent_nodes(RANKS, [_end(0, 31.0), _end(1, 30.5), _end(2, 30.2)], timeout_seconds=30)
    assert blamed == {"node2": "its rank 3 went silent while ranks 0,1,2 waited out the 30 s collective timeout"}


def test_ranks_that_errored_only_after_the_teardown_signalled_them_count_as_silent():
    # Stopped (or stuck) ranks are woken by slurmstepd's SIGCONT and SIGTERM as the job ends,
    # and only then fail in the collective the others had given up on.
    woken = [RankEnd(r, RANKS[r], 22.6, "RuntimeError", "SIGTERM") for r in (2, 3)]
    blamed = silent_nodes(RANKS, [_end(0, 20.1), _end(1, 20.1), *woken], timeout_seconds=20)
    assert list(blamed) == ["node2"] and blamed["node2"].startswith("its ranks 2,3 went silent"), blamed
    # Signalled ranks prove no timeout either.
    assert silent_nodes(RANKS, woken, timeout_seconds=20) == {}


def test_when_every_node_went_silent_nothing_is_blamed():
    # Only a rank outside the rank map reported (a torn-down world): no node can be told apart.
    lone = RankEnd(9, "node9", 40.0, "RuntimeError")
    assert silent_nodes(RANKS, [lone], timeout_seconds=30) == {}


def test_a_node_stays_quarantined_with_its_first_reason_until_released(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    assert quarantine.read(run) == {}
    added = quarantine.add(run, {"node2": "silent"}, "5_1")
    assert [q.node for q in added] == ["node2"]
    assert quarantine.add(run, {"node2": "again", "node3": "down"}, "5_2")[0].node == "node3"
    held = quarantine.read(run)
    assert held["node2"].reason == "silent" and held["node2"].job == "5_1"
    assert quarantine.excluded_nodes(run, ["gpu[1-2]"]) == ["gpu[1-2]", "node2", "node3"]
    assert quarantine.release(run, ["node2", "node7"]) == ["node2"]
    assert list(quarantine.read(run)) == ["node3"]
    assert not list(run.path.glob("quarantine.json.tmp*")) and not list(run.path.glob(".*tmp*"))


def test_concurrent_writers_lose_no_node(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    threads = [threading.Thread(target=quarantine.add, args=(run, {f"node{i}": "x"}, "1")) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(quarantine.read(run)) == 20


def test_an_unreadable_quarantine_file_is_an_error_never_an_empty_set(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.quarantine.write_text("{not json")
    with pytest.raises(ValueError):
        quarantine.read(run)


def test_rank_ends_round_trip_and_a_torn_file_counts_as_silent(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    _end(0, 12.5).write(run, "42", 0)
    _end(1, 12.0).write(run, "42", 0)
    run.rank_end("42", 0, 2).write_text('{"rank": 2, "no')  # killed mid-write
    assert quarantine.read_rank_ends(run, "42", 0) == [_end(0, 12.5), _end(1, 12.0)]
    assert quarantine.read_rank_ends(run, "42", 1) == []  # another attempt of the job
    run.rank_map("42", 0).write_text(json.dumps({str(r): {"node": n, "local_rank": r % 2} for r, n in RANKS.items()}))
    assert quarantine.rank_nodes(run, "42", 0) == RANKS


def test_a_submission_excludes_the_quarantined_nodes_on_the_command_line(tmp_path: Path):
    from jobgen.spec.loader import resolve

    job = {"name": "q", "program": "doctor", "nodes": 1, "time": "1h", "exclude": ["node9"]}
    spec = resolve({"site": "local", "job": job}, spec_file=None, base_dir=tmp_path)
    assert not any(o.startswith("--exclude") for o in sbatch_options(spec))
    assert "--exclude=node9,node2" in sbatch_options(spec, quarantined=["node2", "node9"])


@pytest.mark.parametrize(
    "nodes, spares, usable, asked",
    [
        (2, 1, 3, 3),  # the partition has room for every spare
        (2, 1, 2, 2),  # one of 3 quarantined: the pending task asks for the 2 left, not 3 for ever
        (2, 2, 3, 3),  # some of the spares
        (2, 1, 1, 2),  # fewer than job.nodes: the task waits for job.nodes (doctor, Slurm) as before
        (2, 1, 40, 3),  # a big partition: never more than job.nodes + spare_nodes
    ],
)
def test_a_pending_task_with_spares_asks_for_no_more_nodes_than_the_partition_has_left(nodes, spares, usable, asked):
    """Found by the hour soak: after a lost node was quarantined, the next array task of a 3-node
    cluster still asked for job.nodes + spare_nodes = 3 with the node excluded, and never started."""
    assert quarantine.pending_node_count(nodes, spares, usable) == asked


def test_the_usable_nodes_are_the_partitions_less_unusable_and_excluded(monkeypatch):
    records = [
        {"NodeName": "n1", "State": "IDLE", "Partitions": "debug,short"},
        {"NodeName": "n2", "State": "ALLOCATED", "Partitions": "debug"},
        {"NodeName": "n3", "State": "DOWN+NOT_RESPONDING", "Partitions": "debug"},
        {"NodeName": "n4", "State": "IDLE", "Partitions": "gpu"},
        {"NodeName": "n5", "State": "MIXED", "Partitions": "debug"},
    ]
    monkeypatch.setattr(quarantine.slurm, "nodes", lambda: records)
    monkeypatch.setattr(quarantine.slurm, "hostnames", lambda expr: {"n[4-5]": ["n4", "n5"]}.get(expr, [expr]))
    assert quarantine.usable_partition_nodes("debug", [], set()) == 3  # n1, n2 (busy counts), n5
    assert quarantine.usable_partition_nodes("debug", ["n[4-5]"], {"n1"}) == 1
    assert quarantine.usable_partition_nodes(None, [], set()) == 4  # no partition: every node


def test_a_node_slurm_only_suspects_is_asked_itself_before_it_is_left_out():
    """Found by the hour soak: after a rank's SIGKILL, Slurm marked the surviving node
    MIXED+NOT_RESPONDING for 20 s while its slurmd ended the launch's processes, and the
    supervisor, counting it unusable, ended the task instead of relaunching on it."""
    records = [
        {"NodeName": "n1", "State": "MIXED+NOT_RESPONDING", "NodeAddr": "10.0.0.1"},
        {"NodeName": "n2", "State": "IDLE+NOT_RESPONDING", "NodeAddr": "10.0.0.2", "Reason": "(null)"},
        {"NodeName": "n3", "State": "DOWN+NOT_RESPONDING", "NodeAddr": "10.0.0.3", "Reason": "Not responding"},
        {"NodeName": "n4", "State": "MIXED+DRAIN", "NodeAddr": "10.0.0.4", "Reason": "bad gpu"},
        {"NodeName": "n5", "State": "ALLOCATED", "NodeAddr": "10.0.0.5"},
    ]
    asked = []

    def answers(record):
        asked.append(record["NodeName"])
        return record["NodeName"] in ("n1", "n3")  # n2's slurmd is gone; n3's answers, but Slurm said DOWN

    found = quarantine.unusable_in(records, ["n1", "n2", "n3", "n4", "n5"], answers)
    assert found == {
        "n2": "Slurm marked it IDLE+NOT_RESPONDING and its slurmd does not answer",
        "n3": "Slurm marked it DOWN+NOT_RESPONDING (Not responding)",
        "n4": "Slurm marked it MIXED+DRAIN (bad gpu)",
    }
    assert asked == ["n1", "n2"]  # a verdict (DOWN, DRAIN) is taken as it is; only suspicion is checked
    assert quarantine.unusable_in(records, ["n5"], answers) == {}
