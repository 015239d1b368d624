"""``jobgen data prepare`` ahead of a run: the cache entry the trainer would build, filled by
several tokenizing processes on this machine; the run then starts without tokenizing (its log
says it read the cache) and trains on the same examples as a run that tokenized for itself."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, VENV_BIN, jobgen, losses, make_run, torchrun, wait_for


def _rows(count: int) -> list[dict[str, str]]:
    return [
        {
            "instruction": f"Count to {i % 17}.",
            "input": "" if i % 3 else f"from {i}",
            "output": " ".join("x" * (i % 9 + 1)),
        }
        for i in range(count)
    ]


def test_prepared_data_is_read_not_tokenized_by_the_run(tmp_path, tiny_model):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _rows(2500)))  # 3 shards of 1000 rows
    cache = tmp_path / "cache"
    site = {"profile": "local", "paths": {"data_cache": str(cache)}}
    run = make_run(tmp_path / "ahead", tiny_model, data={"path": str(data)}, site=site, max_steps=4)
    prepared = jobgen("data", "prepare", str(tmp_path / "ahead" / "sft.toml"), "--procs", "2", timeout=600)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "tokenizing 2,500 rows in 3 shard(s) with 2 process(es)" in prepared.stderr, prepared.stderr[-3000:]
    [entry] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert prepared.stdout.startswith(f"data.path: {entry} ") and "2500/2500 examples kept" in prepared.stdout
    assert sorted(p.name for p in (entry / "dataset").glob("*.arrow")) == [
        f"data-0000{k}-of-00003.arrow" for k in range(3)
    ]

    ahead = torchrun(run, nproc=2, timeout=600)
    assert ahead.returncode == 0, ahead.stdout[-3000:] + ahead.stderr[-3000:]
    log = ahead.stdout + ahead.stderr
    assert f"read from the cache entry {entry} (prepared before: no tokenizing)" in log
    assert "tokenizing" not in log.replace("no tokenizing", "")

    # A run that tokenizes for itself, into a cache of its own: the same losses.
    own = make_run(
        tmp_path / "own",
        tiny_model,
        data={"path": str(data)},
        site={"profile": "local", "paths": {"data_cache": str(tmp_path / "c2")}},
        max_steps=4,
    )
    itself = torchrun(own, nproc=2, timeout=600)
    assert itself.returncode == 0, itself.stdout[-3000:] + itself.stderr[-3000:]
    assert "no cache entry" in itself.stdout + itself.stderr
    assert losses(Path(run)) == losses(Path(own)) and len(losses(Path(run))) == 4


def test_prepare_names_the_file_and_row_of_bad_data(tmp_path, tiny_model):
    data = tmp_path / "rows.jsonl"
    rows = _rows(1500)
    rows[1200]["output"] = 7
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    site = {"profile": "local", "paths": {"data_cache": str(tmp_path / "cache")}}
    make_run(tmp_path / "bad", tiny_model, data={"path": str(data)}, site=site)
    refused = jobgen("data", "prepare", str(tmp_path / "bad" / "sft.toml"), "--procs", "2", timeout=600)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"jobgen data prepare: data.path: {data}: row 1200: column 'output' is a int, not a string"
    )
    # Nothing that looks like an entry, and no shards kept for data that must change.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


# --------------------------------------------------------------------------- every node a share


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


NODES = ("node-a", "node-b")


def two_nodes(run: Path, port: int, logs: Path) -> list[subprocess.Popen]:
    """The run as a job of two nodes of one process each would run it: two torchrun agents
    (static rendezvous on this machine), each with its node's name as Slurm gives it, each
    writing to ``logs/<node>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for index, node in enumerate(NODES):
        command = [
            *(str(VENV_BIN / "torchrun"), "--nnodes=2", f"--node-rank={index}", "--nproc-per-node=1"),
            *("--master-addr=127.0.0.1", f"--master-port={port}", "-m", "trainer"),
            *("--run-dir", str(run), "--expected-world-size", "2"),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        with open(logs / f"{node}.log", "w") as out:
            procs.append(
                subprocess.Popen(
                    command,
                    env={**env, "SLURMD_NODENAME": node},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


# The same scenario runs on the dev cluster in CI (tests/cluster/test_slurm_data_prepare.py, where
# Slurm's node loss is real); this one, two gloo "nodes" on this machine without Slurm, is for
# a machine without the cluster (about 3 minutes).
@pytest.mark.full
def test_two_nodes_prepare_a_share_each_and_a_killed_node_is_named(tmp_path, tiny_model):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _rows(80_000)))  # 64 shards of 1250 rows
    cache = tmp_path / "cache"
    site = {"profile": "local", "paths": {"data_cache": str(cache)}}
    one_process = {"path": str(data), "num_proc": 1}  # each node's share takes seconds

    # node-b is killed once it has started tokenizing: node-a names it; nothing is published.
    run = make_run(tmp_path / "killed", tiny_model, data=one_process, site=site, max_steps=2)
    logs = tmp_path / "killed-logs"
    procs = two_nodes(run, free_port(), logs)
    try:
        wait_for(lambda: list(cache.glob(".shards-*/nodes/node-0001.json")), 300, "node-b to begin", interval=0.1)
        # The node's agent and its worker (torchrun starts each worker in a session of its own).
        worker = re.search(r"on node-b \(local rank 0\), pid (\d+)", (logs / "node-b.log").read_text())
        os.killpg(procs[1].pid, signal.SIGKILL)
        os.kill(int(worker.group(1)), signal.SIGKILL)
        failed = wait_for(
            lambda: [line for line in (logs / "node-a.log").read_text().splitlines() if "preparation failed" in line],
            120,
            lambda: (logs / "node-a.log").read_text()[-3000:],
        )
        # A crash (1), which the next attempt may not meet: never the data error (18) that stops the run.
        exited = wait_for(lambda: re.search(r"INFO exit (\d+): ", (logs / "node-a.log").read_text()), 120, "the exit")
    finally:
        stop(procs)
    assert "node(s) node-b stopped while tokenizing; nothing was published" in failed[0], failed
    assert exited.group(1) == "1", exited.group(0)
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")], "nothing that looks like an entry"
    [shards] = cache.glob(".shards-*")
    done_before = sorted(p.name for p in (shards / "done").glob("shard-*.json"))

    # Resubmitted: each node logs its share, the shards done before are not done again, and the
    # entry is a one-node build's, byte for byte.
    again = make_run(tmp_path / "again", tiny_model, data=one_process, site=site, max_steps=2)
    nodes = two_nodes(again, free_port(), tmp_path / "again-logs")
    try:
        codes = [proc.wait(600) for proc in nodes]
    finally:
        stop(nodes)
    outs = [(tmp_path / "again-logs" / f"{node}.log").read_text() for node in NODES]
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert all(f"node {node} (" in out and "tokenizes its share" in out for node, out in zip(NODES, outs)), outs
    assert "share of 64 shards: 0, 2, 4, 6, " in outs[0] and "share of 64 shards: 1, 3, 5, 7, " in outs[1]
    tokenized = sum(int(m) for out in outs for m in re.findall(r"tokenizing (\d+) rows in", out.replace(",", "")))
    assert done_before and tokenized == 80_000 - 1250 * len(done_before), (done_before, outs)
    [entry] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    alone = tmp_path / "alone"
    make_run(
        tmp_path / "one", tiny_model, data=one_process, site={"profile": "local", "paths": {"data_cache": str(alone)}}
    )
    prepared = jobgen("data", "prepare", str(tmp_path / "one" / "sft.toml"), timeout=600)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    [single] = [p for p in alone.iterdir() if not p.name.startswith(".")]
    assert single.name == entry.name
    for file in sorted((single / "dataset").iterdir()):
        assert (entry / "dataset" / file.name).read_bytes() == file.read_bytes(), file.name


def test_bad_data_on_one_node_stops_the_other_and_is_the_error_named(tmp_path, tiny_model):
    """node-b meets a bad row in its first shard and removes the shard directory (the data must
    change); node-a, with most of its share still to tokenize, stops where it would next write
    instead of tokenizing on, and the run ends with node-b's data error (18: no retry), not
    node-a's failure to write (a crash another attempt would repeat, burning the array)."""
    rows = _rows(80_000)  # 64 shards of 1250 rows; node-b's first is shard 1
    rows[1300]["output"] = 7
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cache = tmp_path / "cache"
    site = {"profile": "local", "paths": {"data_cache": str(cache)}}
    run = make_run(tmp_path / "bad", tiny_model, data={"path": str(data), "num_proc": 1}, site=site, max_steps=2)
    logs = tmp_path / "logs"
    procs = two_nodes(run, free_port(), logs)
    try:
        codes = [proc.wait(600) for proc in procs]
    finally:
        stop(procs)
    out = (logs / "node-a.log").read_text()
    assert codes != [0, 0], out[-3000:]
    exited = re.search(r"INFO exit (\d+): (.*)", out)
    assert exited and exited.group(1) == "18", out[-3000:]
    assert f"node node-b: data.path: {data}: row 1300: column 'output' is a int, not a string" in exited.group(2)
    # node-a stopped early: far from its 32 shards, and nothing of the data that must change is kept.
    assert "node node-a finished its share" not in out, out[-3000:]
    assert "data: node node-a stopped early: the shard directory was removed" in out, out[-3000:]
    assert not list(cache.iterdir()), list(cache.iterdir())
