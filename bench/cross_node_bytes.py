"""Bytes sent across nodes per optimizer step, FSDP against HSDP, on the dev cluster.

Each dev-cluster node is its own network namespace joined to the host's bridge by a veth
(jobgen/devcluster/netns.py); what a node sends to another node crosses its veth, while
the traffic between two processes of one node stays on that namespace's loopback. So the
bytes the host side of the veths receive are exactly the bytes that left their nodes.

Two runs of the same model and batch on 2 nodes x 2 processes (gloo over the netns links):
``parallelism = "fsdp"`` (one shard group of 4: every block's parameters are all-gathered
from both nodes, forward and backward, and gradients reduce-scattered over them) and
``"hsdp"`` (shard within the node, replicate across: the all-gathers stay on the node, the
gradient shards are all-reduced across nodes once a step). The counters are sampled while
each run trains; bytes per step are their growth between two logged steps past the start,
so start-up (rendezvous, loading) and the final save are not counted. The figure is the
ratio HSDP / FSDP, measured in the same invocation.

On the dev cluster as the test session starts it (``jobgen cluster up --netns --nodes 3
--cpus-per-node 4``, as root), when nothing else uses it (about 3 minutes):

    .venv/bin/python bench/cross_node_bytes.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from cluster_counts import sent_bytes

from helpers import cancel_submitted, last_step, submit, train_spec, wait_for

NODES = ("node1", "node2")
SHAPE = {"hidden_size": 256, "layers": 4, "heads": 4, "vocab_size": 2048}  # ~3.7M parameters


def bytes_per_step(run: Path, first: int, last: int, timeout: float) -> float:
    """Counter growth between the moments ``first`` and ``last`` are first logged, per step."""
    marks: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + timeout
    while last not in marks:
        if time.monotonic() > deadline:
            raise SystemExit(f"{run.name}: step {last} not reached in {timeout:.0f} s")
        step, counted = last_step(run), sent_bytes(NODES)
        for wanted in (first, last):
            if step >= wanted and wanted not in marks:
                marks[wanted] = (step, counted)
        time.sleep(0.05)
    (s1, b1), (s2, b2) = marks[first], marks[last]
    return (b2 - b1) / max(s2 - s1, 1)


def measure(work: Path, model: Path, parallelism: str, steps: tuple[int, int]) -> float:
    spec = train_spec(
        work,
        model,
        f"bytes-{parallelism}",
        nodes=2,
        procs_per_node=2,
        job={"nodelist": list(NODES)},
        parallelism=parallelism,
        micro_batch_size=2,
        max_steps=steps[1] + 5,
        save_every="24h",
    )
    submit(spec)
    run = work / "runs" / f"bytes-{parallelism}"
    try:
        per_step = bytes_per_step(run, *steps, timeout=600)
        wait_for(lambda: (run / "done").exists(), 300, f"{run.name} to finish")
    finally:
        cancel_submitted()
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=5, help="the step the count starts at")
    parser.add_argument("--last", type=int, default=25, help="the step it ends at")
    args = parser.parse_args()
    from jobgen.cli.tinymodel import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="jobgen-bytes-") as tmp:
        work = Path(tmp)
        model = work / "model"
        make_tiny_model(model, **SHAPE)
        figures = {p: measure(work, model, p, (args.first, args.last)) for p in ("fsdp", "hsdp")}
    for parallelism, per_step in figures.items():
        print(f"{parallelism}: {per_step / 2**20:.2f} MiB sent across nodes per step (steps {args.first}-{args.last})")
    print(f"hsdp / fsdp: {figures['hsdp'] / figures['fsdp']:.3f}")


if __name__ == "__main__":
    main()
