"""Issue 49's data preparation on the real dev cluster: a 2-node run (one process per node)
tokenizes its data on both nodes, each node's first rank a share of the shards that its own log
lists; a node killed in the middle of it fails the preparation with one line naming that node,
and nothing that looks like a cache entry is left, only the shards done; the run submitted
again tokenizes only the shards that are missing (each node's log says how many of its share it
kept) and trains; and the entry it publishes is, byte for byte, what ``jobgen data prepare``
builds on one machine. (tests/distributed/test_data_prepare.py proves the same with two local
torchrun "nodes".)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import (
    jobgen,
    kill_node,
    last_step,
    revive_node,
    running_task,
    slurm_setting,
    stop_run,
    submit,
    wait_for,
    wait_until_gone,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.lifecycle, pytest.mark.timeout(600)]

# 64 shards of 1,250 rows, 32 per node; tokenized by one process per node (data.num_proc), a
# node's share takes about ten seconds on the dev cluster: time to kill it in the middle.
ROWS, SHARDS, SHARD_ROWS = 80_000, 64, 1250


def write_rows(path: Path) -> Path:
    rows = (
        {
            "instruction": f"Count to {i % 17}.",
            "input": "" if i % 3 else f"from {i}",
            "output": " ".join("x" * (i % 9 + 1)),
        }
        for i in range(ROWS)
    )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def node_logs(run: Path, job: int) -> dict[str, str]:
    """Each node's log of one job (its first rank's output, torchrun's copy per node)."""
    logs: dict[str, str] = {}
    for log in sorted((run / "logs" / "ranks" / str(job)).glob("*/*/attempt_*/0/stdout.log")):
        node = log.relative_to(run / "logs" / "ranks" / str(job)).parts[0]
        logs[node] = logs.get(node, "") + log.read_text(errors="replace")
    return logs


def done_shards(shards: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("shard-")) for p in (shards / "done").glob("shard-*.json"))


def exit_reason(run: Path, job: int) -> tuple[int, str] | None:
    """The attempt's exit record (rank 0's code and reason), once written."""
    path = RunDir(run).exit_code_file(job, 0)
    lines = path.read_text().split("\n") if path.exists() else []
    return (int(lines[0]), lines[1]) if lines and lines[0].isdigit() else None


def tokenized_rows(log: str) -> int:
    return sum(int(n.replace(",", "")) for n in re.findall(r"tokenizing ([\d,]+) rows in \d+ shard", log))


def killed_during_preparation(cluster, run, cache: Path) -> list[int]:
    """Submits the run, kills its second node once both nodes tokenize and one of that node's
    shards is done, and checks how the preparation failed (:func:`named`); the shards done."""
    # Slurm must not end the job (its node failure) before rank 0 has finished its own share and
    # found the other node gone: SlurmdTimeout at Slurm's default, not the dev cluster's 20 s.
    with slurm_setting("SlurmdTimeout", "300"):
        array = submit(run.spec)
        task = running_task(array, 1, timeout=180)
        batch_host, victim = slurm.hostnames(slurm.show_job(task)[0]["NodeList"])

        def tokenizing() -> bool:
            logs = node_logs(run.path, task)
            started = all("tokenizing 40,000 rows in 32 shard(s)" in logs.get(n, "") for n in (batch_host, victim))
            return started and any(k % 2 for shards in cache.glob(".shards-*") for k in done_shards(shards))

        wait_for(tokenizing, 240, lambda: f"both nodes to tokenize: {node_logs(run.path, task)}", interval=0.1)
        try:
            kill_node(victim)
            line = named(run.path, task, victim)
        finally:
            revive_node(cluster, victim)
    slurm.cancel(array)  # else Slurm requeues it, once it finds the node failed
    wait_until_gone([array], timeout=180)
    # Nothing that looks like an entry: only the shard directory, with no dataset to read.
    [shards] = cache.iterdir()
    assert shards.name.startswith(".shards-") and not (shards / "stats.json").exists(), shards
    assert not (shards / "dataset" / "state.json").exists()
    done = done_shards(shards)
    assert set(range(0, SHARDS, 2)) <= set(done) and 0 < len(done) < SHARDS, done  # batch_host's share whole
    print(f"killed {victim}: {line}")
    return done


def named(run: Path, task: int, victim: str) -> str:
    """Rank 0's one line: the preparation failed because ``victim`` stopped while tokenizing."""
    code, reason = wait_for(lambda: exit_reason(run, task), 120, "rank 0's exit record")
    # Rank 0 finished its node's share, then found the other node gone: a crash the next attempt
    # may not meet (1), never the data error (18) that stops the run.
    assert code == ExitCode.CRASHED, (code, reason)
    assert reason.startswith(
        f"crashed: PreparationStopped: rank 0: the data preparation failed: node(s) {victim} stopped while "
        "tokenizing; nothing was published, and the shards done are kept for the next attempt ("
    ), reason
    out = run / "logs" / f"{run.name}-{task}.out"
    wait_for(lambda: " INFO exit " in out.read_text(), 60, "the exit line in the job's output")
    [line] = [x for x in out.read_text().splitlines() if " INFO exit " in x]
    assert f"INFO exit 1: {reason[:200]}" in line, line
    return line


def test_two_nodes_prepare_a_share_each_and_a_killed_node_is_named(cluster, cluster_run, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl")
    cache = tmp_path / "cache"
    site = {"profile": "local", "paths": {"data_cache": str(cache)}}
    run = cluster_run("prep", nodes=2, procs_per_node=1, site=site, data={"path": str(data), "num_proc": 1})
    done_before = killed_during_preparation(cluster, run, cache)

    # Submitted again: each node tokenizes the shards of its share not done yet, and trains.
    array = submit(run.spec)
    task = running_task(array, 1, timeout=180)
    nodes = slurm.hostnames(slurm.show_job(task)[0]["NodeList"])
    wait_for(lambda: last_step(run.path, task) >= 1, 240, "the first step")
    stop_run(run.path, [array])
    logs = node_logs(run.path, task)
    assert sorted(logs) == sorted(nodes), (nodes, sorted(logs))
    for index, node in enumerate(nodes):
        log = logs[node]
        assert f"data: node {node} ({index + 1} of 2) tokenizes its share of the shards" in log, log
        mine = [k for k in done_before if k % 2 == index]
        listed = ", ".join(map(str, range(index, 16, 2)))
        assert f"this node's share of {SHARDS} shards: {listed} and 24 more; {len(mine)} of 32 done before" in log, log
        assert tokenized_rows(log) == (32 - len(mine)) * SHARD_ROWS, log
        assert f"data: node {node} finished its share" in log, log
    reused = [x for x in logs[nodes[1]].splitlines() if "done before" in x]
    print(f"submitted again on {','.join(nodes)}: {reused[0]}")

    # The entry the two nodes published is the one a single machine builds, byte for byte.
    [entry] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert [p.name for p in cache.iterdir()] == [entry.name], "the shard directory became the entry"
    same_as_one_machine(run.spec, cache, entry, tmp_path / "alone")


def same_as_one_machine(spec_file: Path, cache: Path, entry: Path, alone: Path) -> None:
    """``entry`` (built by the nodes in ``cache``) is, file for file and byte for byte, what
    ``jobgen data prepare`` builds on this one machine into ``alone``."""
    spec = alone.parent / f"{alone.name}.toml"
    spec.write_text(spec_file.read_text().replace(json.dumps(str(cache)), json.dumps(str(alone))))
    prepared = jobgen("data", "prepare", str(spec), "--procs", "2", timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    [single] = [p for p in alone.iterdir() if not p.name.startswith(".")]
    assert single.name == entry.name
    files = sorted(p.name for p in (single / "dataset").iterdir())
    assert files == sorted(p.name for p in (entry / "dataset").iterdir()) and len(files) == SHARDS + 2, files
    for name in files:
        assert (entry / "dataset" / name).read_bytes() == (single / "dataset" / name).read_bytes(), name


def test_prepare_ahead_on_two_nodes_of_a_cpu_job(cluster, cluster_run, tmp_path):
    """``jobgen data prepare --nodes 2``: a CPU job of its own (srun, in the foreground) whose two
    nodes each tokenize a share, publishing the entry a single machine builds, byte for byte."""
    data = write_rows(tmp_path / "rows.jsonl")
    cache = tmp_path / "cache"
    site = {"profile": "local", "paths": {"data_cache": str(cache)}}
    run = cluster_run("ahead", nodes=2, procs_per_node=1, site=site, data={"path": str(data), "num_proc": 1})
    proc = jobgen("data", "prepare", str(run.spec), "--nodes", "2", "--time", "10m", timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "a CPU job of 2 node(s): srun --job-name=ahead-data --nodes=2 --ntasks-per-node=1" in proc.stderr
    shares = re.findall(r"data: node (\S+) \((\d) of 2\) tokenizes its share of the shards", proc.stderr)
    assert sorted(index for _node, index in shares) == ["1", "2"] and len({n for n, _ in shares}) == 2, proc.stderr
    assert proc.stderr.count(f"tokenizing {ROWS // 2:,} rows in {SHARDS // 2} shard(s)") == 2, proc.stderr
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("data.path: ")]
    [entry] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert line.startswith(f"data.path: {entry} ("), line
    assert not list(cache.glob(".shards-*")), "the shard directory became the entry"

    same_as_one_machine(run.spec, cache, entry, tmp_path / "alone")
