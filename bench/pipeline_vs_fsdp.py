"""Pipeline parallel against FSDP across two nodes joined by a throttled link, on the dev cluster.

The seed-000 user's shape: two machines on Gigabit Ethernet, where FSDP's all-gathers of
every block (forward and backward) and its gradient reduce-scatters cross the slow link each
step, while a pipeline sends only the activations of its micro-batches (and their gradients
back) between the stages. Each dev-cluster node is a network namespace joined to the host's
bridge by a veth (jobgen/devcluster/netns.py); a token bucket (``tc qdisc ... tbf``) on the
host side of each veth limits what every node receives, so every byte between the nodes
crosses one 1 Gbit/s link (``--rate``). The qdiscs are removed when the bench ends.

Two runs of the same model, data and global batch on 2 nodes x 1 process (gloo over the
links): ``parallelism = "fsdp"`` (sharded over both ranks) and ``"pipeline"`` (2 stages,
``--schedule``, the batch split into micro-batches). Reported, from the same invocation:
useful tokens/s (non-padding tokens per second of training, metrics.jsonl's ``tokens_per_s``,
the median over the measured steps) and bytes crossing the nodes per step (the veth counters'
growth between two logged steps past the start), and the ratios pipeline / FSDP.

On the dev cluster as the test session starts it (``jobgen cluster up --netns --nodes 3
--cpus-per-node 4``, as root), when nothing else uses it (about 5 minutes):

    .venv/bin/python bench/pipeline_vs_fsdp.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from cluster_counts import bytes_and_rate, sent_bytes

from helpers import submit, train_spec
from jobgen.devcluster.netns import veth_name

NODES = ("node1", "node2")
# ~25M parameters: big enough that FSDP's traffic dominates a step at 1 Gbit/s, small enough
# for 2 CPU processes (the bench machine has 2 cores).
SHAPE = {"hidden_size": 512, "layers": 4, "heads": 8, "vocab_size": 8192, "intermediate_size": 1408}


def throttle(rate: str | None) -> None:
    """A token bucket of ``rate`` on what each node receives (None: remove it)."""
    for node in NODES:
        dev = veth_name(node)
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)  # absent is fine
        if rate:
            subprocess.run(
                ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
                check=True,
            )


def measure(work: Path, model: Path, name: str, steps: tuple[int, int], **keys: object) -> tuple[float, float]:
    """(bytes across the nodes per step, median useful tokens/s) of one run between two steps."""
    spec = train_spec(
        work,
        model,
        name,
        nodes=2,
        procs_per_node=1,
        job={"nodelist": list(NODES)},
        micro_batch_size=4,
        max_steps=steps[1] + 2,
        save_every="24h",
        **keys,
    )
    submit(spec)
    return bytes_and_rate(work / "runs" / name, steps, lambda: sent_bytes(NODES), name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="the link's rate (tc's syntax); 'none' for no limit")
    parser.add_argument("--schedule", default="1f1b", help="train.pipeline.schedule")
    parser.add_argument("--first", type=int, default=3, help="the step the count starts at")
    parser.add_argument("--last", type=int, default=10, help="the step it ends at")
    args = parser.parse_args()
    from jobgen.cli.tinymodel import make_tiny_model

    steps = (args.first, args.last)
    throttle(None if args.rate == "none" else args.rate)
    try:
        with tempfile.TemporaryDirectory(prefix="jobgen-pp-") as tmp:
            work = Path(tmp)
            model = work / "model"
            make_tiny_model(model, **SHAPE)
            fsdp = measure(work, model, "bench-fsdp", steps, parallelism="fsdp")
            pipeline = {"schedule": args.schedule}
            pp = measure(work, model, "bench-pipeline", steps, parallelism="pipeline", pipeline=pipeline)
    finally:
        throttle(None)
    for name, (per_step, rate) in (("fsdp", fsdp), (f"pipeline {args.schedule}", pp)):
        print(f"{name}: {per_step / 2**20:.2f} MiB across the nodes per step, {rate:.0f} useful tokens/s")
    print(f"link: {args.rate}; steps {args.first}-{args.last}; model {SHAPE}")
    print(f"pipeline / fsdp: tokens/s {pp[1] / fsdp[1]:.2f}, bytes per step {pp[0] / fsdp[0]:.3f}")


if __name__ == "__main__":
    main()
