"""Goodput on the dev cluster: the same run through time limits and a preemption, with and
without graceful stops.

Two runs of the same model, data and settings train side by side, one node (2 processes)
each, as 3-task arrays of 3-minute jobs with periodic checkpoints every minute. Task 2 of
each is requeued (``scontrol requeue``: SIGTERM to every process, as preemption does) 90 s
after its first step. The runs differ in one key:

- ``graceful``: ``job.graceful_stop = true`` (the default): the lead-time signal 40 s
  before each limit and the preemption's SIGTERM make the trainer save and exit;
- ``periodic only``: ``job.graceful_stop = false``: the trainer ignores both and is killed;
  each task resumes from the last periodic checkpoint and redoes the steps since.

Measured from outside the trainer: each job's allocated seconds (seen RUNNING by polling
``squeue`` every second), the steps kept at the end (the newest complete checkpoint), the
median step time; goodput = kept steps x step time / allocated seconds. From the run
directory (``jobgen status --json``): recomputed steps and each task's start to first step.

On the dev cluster as the test session starts it (``jobgen cluster up --netns --nodes 3
--cpus-per-node 4``, as root), with no test session or other benchmark using it (about 13
minutes):

    .venv/bin/python bench/goodput.py [--work DIR]

Prints a table and writes ``DIR/goodput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import cancel_submitted, first_step_record, read_jsonl, status, submit, train_spec

VARIANTS = {"graceful": True, "periodic only": False}
TIME_LIMIT, GRACE, TASKS = "3m", "40s", 3
PREEMPT_AFTER_S = 90  # after task 2's first step: 30 s past its first periodic save
# jobgen.cli.tinymodel.make_tiny_model's keywords: steps of a fraction of a second on 2 processes.
SHAPE = {"hidden_size": 512, "layers": 4, "intermediate_size": 1376, "heads": 8, "kv_heads": 8}


class Allocations:
    """Seconds each job was seen RUNNING, per attempt (a requeued job runs again under its id)."""

    def __init__(self) -> None:
        self.attempts: dict[int, list[list[float]]] = {}  # job id -> [[first seen, last seen], ...]
        self._running: set[int] = set()

    def poll(self, array_ids: list[int]) -> bool:
        """One look at the queue; False once none of the arrays has a job left."""
        from jobgen.slurm import client as slurm

        entries = slurm.queue(array_ids)
        now = time.time()
        running = {e.job_id for e in entries if e.state in ("RUNNING", "COMPLETING")}
        for job in running:
            if job not in self._running:
                self.attempts.setdefault(job, []).append([now, now])
            self.attempts[job][-1][1] = now
        self._running = running
        return bool(entries)

    def seconds(self) -> float:
        return sum(last - first for spans in self.attempts.values() for first, last in spans)


def kept_step(run: Path) -> int:
    from jobgen.runs.rundir import complete_checkpoints_in

    found = complete_checkpoints_in(run / "checkpoints")
    return found[-1][0] if found else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from jobgen import devcluster
    from jobgen.cli.tinymodel import make_tiny_model

    if devcluster.status() is None:
        sys.exit("no dev cluster is up: jobgen cluster up --netns --nodes 3 --cpus-per-node 4")
    with tempfile.TemporaryDirectory(prefix="jobgen-goodput-") as tmp:
        work = args.work or Path(tmp)
        model = make_tiny_model(work / "model", **SHAPE)
        runs, arrays = {}, {}
        for variant, graceful in VARIANTS.items():
            name = "goodput-graceful" if graceful else "goodput-periodic"
            spec = train_spec(
                work, model, name, time_limit=TIME_LIMIT, grace=GRACE, array=TASKS, save_every="1m", log_every_steps=5
            )
            if not graceful:
                text = spec.read_text()
                assert "\n[job]\n" in text, text
                spec.write_text(text.replace("\n[job]\n", "\n[job]\ngraceful_stop = false\n", 1))
            runs[variant], arrays[variant] = work / "runs" / name, submit(spec)
        try:
            results = measure(runs, arrays)
        finally:
            cancel_submitted()
    report(results)
    out = (args.work or Path.cwd()) / "goodput.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


def measure(runs: dict[str, Path], arrays: dict[str, int]) -> dict[str, dict]:
    allocations = {variant: Allocations() for variant in runs}
    preempted: dict[str, float] = {}
    while True:
        alive = [allocations[v].poll([arrays[v]]) for v in runs]
        for variant, run in runs.items():
            if variant in preempted:
                continue
            task2 = running_task_now(arrays[variant], 2)
            record = first_step_record(run, task2) if task2 else None
            if record and time.time() - record["time"] >= PREEMPT_AFTER_S:
                subprocess.run(["scontrol", "requeue", f"{arrays[variant]}_2"], check=True, capture_output=True)
                preempted[variant] = time.time()
        if not any(alive):
            break
        time.sleep(1)
    results = {}
    for variant, run in runs.items():
        steps = [float(line["step_seconds"]) for line in read_jsonl(run / "metrics.jsonl") if "step_seconds" in line]
        view = status(run)
        step_s = statistics.median(steps)
        kept = kept_step(run)
        allocated = allocations[variant].seconds()
        phases = [r.get("startup_seconds") for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "first_step"]
        results[variant] = {
            "allocated_seconds": round(allocated, 1),
            "jobs": sum(len(spans) for spans in allocations[variant].attempts.values()),
            "kept_steps": kept,
            "median_step_seconds": round(step_s, 3),
            "goodput": round(kept * step_s / allocated, 3),
            "recomputed_steps": sum(t["recomputed_steps"] for t in view["tasks"]),
            "seconds_to_first_step": [t["seconds_to_first_step"] for t in view["tasks"]],
            "startup_seconds": phases,
            "status_goodput": view["goodput"],
            "exit_reasons": [t["exit_reason"] for t in view["tasks"]],
        }
    return results


def running_task_now(array: int, index: int) -> int | None:
    """The job id of array task ``index`` if it is running now."""
    from jobgen.slurm import client as slurm

    found = [e.job_id for e in slurm.queue([array]) if e.array_task == str(index) and e.state == "RUNNING"]
    return found[0] if found else None


def report(results: dict[str, dict]) -> None:
    base = results["periodic only"]
    print(f"{'':<16} {'allocated':>10} {'jobs':>5} {'kept steps':>11} {'step':>7} {'goodput':>8} {'recomputed':>11}")
    for variant, r in results.items():
        print(
            f"{variant:<16} {r['allocated_seconds']:9.0f}s {r['jobs']:5d} {r['kept_steps']:11d} "
            f"{r['median_step_seconds']:6.2f}s {r['goodput']:8.3f} {r['recomputed_steps']:11d}"
        )
    # Goodput is a fraction of each run's own time, so it compares runs whose steps ran at
    # different speeds (the two share the machine's cores, unevenly); steps per second would not.
    print(f"goodput, graceful / periodic only: x{results['graceful']['goodput'] / base['goodput']:.2f}")
    print("jobgen status's goodput: " + ", ".join(f"{v} {r['status_goodput']}" for v, r in results.items()))
    for variant, r in results.items():
        print(f"{variant}: start to first step per job {r['seconds_to_first_step']}")


if __name__ == "__main__":
    main()
