"""What a training step costs outside itself: the time between two steps of jobgen's trainer that
is not in either (the step boundary's decision, the metrics line, the heartbeat, a snapshot), per
step and as a share of the step, with one gloo all-reduce between the same processes measured in
the same run as the unit it is counted in.

Two processes on this machine (gloo), the tiny model, steps paced to ``--pace`` seconds as the dev
cluster's scenarios pace them (tests/paced: each step starts a period after the previous one, so
the time outside the steps is what the steps' own timer misses), for ``--steps`` steps: once
without snapshots and once with train.snapshot_every_steps = 5 (the hour soak's setting). That
share of a step is what goodput loses at every step whatever the faults (docs/long-runs.md).

    .venv/bin/python bench/step_boundary.py [--work DIR] [--steps 200] [--pace 0.4]

Prints a table and writes ``DIR/step_boundary.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_run import prepared_run, train

from helpers import PACED, REPO, VENV_BIN

ALL_REDUCE = textwrap.dedent(
    """
    import sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.zeros(12, dtype=torch.float64)
    for _ in range(100):
        dist.all_reduce(t)
    began, n = time.perf_counter(), 1000
    for _ in range(n):
        dist.all_reduce(t)
    if dist.get_rank() == 0:
        print((time.perf_counter() - began) / n)
    dist.destroy_process_group()
    """
)


def all_reduce_seconds(work: Path) -> float:
    """One all-reduce of the step's 12 numbers between 2 gloo processes of this machine."""
    script = work / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script)]
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    ).stdout
    return float(out.strip().splitlines()[-1])


def outside_the_steps(work: Path, model: Path, name: str, steps: int, pace: float, snapshots: int) -> dict:
    """Train ``steps`` paced steps; the mean time between two steps' ends less the mean step."""
    train_keys = {"micro_batch_size": 4, "max_steps": steps, "log_every_steps": 1, "save_every_steps": 0, "seed": 3}
    job = {}
    if snapshots:
        train_keys["snapshot_every_steps"] = snapshots
        job = {"in_job_restarts": 1}  # snapshots are read only by a relaunch inside the task
    run, _ = prepared_run(
        work,
        name,
        procs=2,
        job=job,
        model={"path": str(model)},
        data={"path": str(REPO / "jobgen/bundled/examples/data/instructions.jsonl"), "max_length": 256},
        train=train_keys,
    )
    train(run, 2, env={"PYTHONPATH": f"{REPO}:{PACED}", "PACED_STEP_SECONDS": str(pace)})
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in lines if "loss" in line][10:]  # past the first steps' warm-up
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(lines)]
    step = statistics.mean(line["step_seconds"] for line in lines[1:])
    outside = statistics.mean(gaps) - step
    return {"steps": len(gaps), "step_seconds": round(step, 5), "outside_ms": round(outside * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pace", type=float, default=0.4)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="step-boundary-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        from jobgen.cli.tinymodel import make_tiny_model

        make_tiny_model(model)
    unit = all_reduce_seconds(work)
    rows = {
        "no snapshots": outside_the_steps(work, model, "plain", args.steps, args.pace, 0),
        "snapshots every 5 steps": outside_the_steps(work, model, "snapshots", args.steps, args.pace, 5),
    }
    print(f"one all-reduce of 12 numbers, 2 gloo processes: {unit * 1e3:.2f} ms; steps paced to {args.pace} s")
    print(f"{'':26} {'outside a step':>15} {'all-reduces':>12} {'share of a step':>16}")
    for name, row in rows.items():
        share = row["outside_ms"] / 1e3 / args.pace
        row["in_all_reduces"] = round(row["outside_ms"] / 1e3 / unit, 2)
        row["share_of_step"] = round(share, 5)
        print(f"{name:26} {row['outside_ms']:>12.2f} ms {row['in_all_reduces']:>12.2f} {share:>15.2%}")
    result = {"pace": args.pace, "all_reduce_ms": round(unit * 1e3, 3), "rows": rows}
    (work / "step_boundary.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
