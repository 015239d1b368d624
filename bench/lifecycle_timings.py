"""How long the lifecycle behaviours take: the durations the tests no longer assert.

The tests check what happens (a kill switch present at start exits before the model is
loaded; a hung rank's job is ended by the collective timeout, not the time limit; a wrong
network interface fails before the rendezvous; the queued tasks of a stopped run leave
before launching anything; a second ``cluster up`` restarts nothing). How long each takes
depends on the machine and its load, so it is measured here and printed, never asserted.

On any machine with the [train] extra, no cluster needed (about a minute on 2 CPU cores):

    .venv/bin/python bench/lifecycle_timings.py local

On the dev cluster, as the test session starts it (``jobgen cluster up --netns --nodes 3
--cpus-per-node 4``, as root). It submits training jobs and SIGSTOPs a rank, so run it
when no test session or soak is using that cluster (about 6 minutes):

    .venv/bin/python bench/lifecycle_timings.py cluster

Each line names what was measured, the seconds it took, and what to compare them with.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

# The tests' helpers build the runs and wait on them, as in the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import (
    cancel_submitted,
    doctor_spec,
    exit_record,
    last_step,
    make_run,
    read_jsonl,
    running_task,
    stop_run,
    submit,
    torchrun,
    train_spec,
    wait_for,
    wait_for_step,
    wait_until_gone,
    worker_pids,
)


def report(what: str, seconds: float, compare: str) -> None:
    print(f"{what:<44} {seconds:7.1f} s   {compare}", flush=True)


def local(work: Path, model: Path) -> None:
    """Kill switch present at start, against a normal start's time to its first step."""
    normal = make_run(work / "normal", model, max_steps=1_000)
    started = time.monotonic()
    proc = torchrun(normal, background=True)
    wait_for_step(normal, proc, 1)
    first_step = time.monotonic() - started
    (normal / "switches" / "kill").touch()
    proc.communicate(timeout=300)

    stopped = make_run(work / "stopped", model)
    (stopped / "switches" / "kill").touch()
    started = time.monotonic()
    done = torchrun(stopped)
    at_start = time.monotonic() - started
    assert "kill switch present at start: not starting" in done.stdout + done.stderr, done.stdout + done.stderr
    report(
        "kill switch at start: torchrun to exit",
        at_start,
        f"{at_start / first_step:.2f} x the {first_step:.1f} s a normal start takes to its first step",
    )


def run_seconds(record: dict[str, str]) -> int:
    """Slurm's RunTime ([D-]HH:MM:SS) in seconds."""
    days, _, clock = record["RunTime"].rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def cluster(work: Path, model: Path) -> None:
    from jobgen import devcluster
    from jobgen.slurm import client as slurm

    info = devcluster.status()
    assert info is not None, "no dev cluster is up: jobgen cluster up --netns --nodes 3 --cpus-per-node 4"
    started = time.monotonic()
    devcluster.up(**info.shape, state_dir=info.state_dir)
    report("second `cluster up` (nothing to do)", time.monotonic() - started, "")

    # USR1 (scancel --signal, preemption set-ups) to the trainer's exit record.
    spec = train_spec(work, model, "bench-usr1")
    run = work / "runs" / "bench-usr1"
    array = submit(spec)
    task = running_task(array, 1)
    wait_for(lambda: last_step(run, task) >= 3, 180, "training")
    signalled = time.time()
    slurm.cancel(f"{array}_1", signal="USR1")
    done = wait_for(lambda: exit_record(run, task), 180, "the exit after USR1")
    step_s = read_jsonl(run / "metrics.jsonl")[-1]["step_seconds"]
    report("USR1 to the trainer's exit (saved)", done["time"] - signalled, f"one step takes {step_s:.2f} s")
    wait_until_gone([array])

    # A rank stuck inside a step: from SIGSTOP to the next array task running.
    spec = train_spec(work, model, "bench-hang", array=2, save_every_steps=5, collective_timeout="30s")
    run = work / "runs" / "bench-hang"
    array = submit(spec)
    task = running_task(array, 1)
    wait_for(lambda: last_step(run, task) >= 7, 180, "training")
    os.kill(worker_pids(run)[-1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    running_task(array, 2, timeout=600)
    ended = time.monotonic() - stopped_at
    report("hung rank to the next task running", ended, f"{ended / 30:.1f} x collective_timeout (30 s); time limit 10m")
    stop_run(run, [array])

    # A network interface the nodes do not have: submit to the job gone.
    spec = doctor_spec(
        work / "nic", "bench-nic", site={"profile": "local", "network": {"ifname": "eth9"}}, nodes=2, procs_per_node=2
    )
    started = time.monotonic()
    job = submit(spec)
    wait_until_gone([job], timeout=300)
    report("wrong NIC: submit to failed", time.monotonic() - started, "the rendezvous was never reached")

    # The queued tasks of a stopped run burn through.
    spec = train_spec(work, model, "bench-burn", array=3)
    run = work / "runs" / "bench-burn"
    array = submit(spec)
    (run / "switches" / "kill").touch()
    wait_until_gone([array], timeout=300)
    for record in sorted(slurm.show_job(array), key=lambda r: int(r["ArrayTaskId"]))[1:]:
        report(f"kill switch: array task {record['ArrayTaskId']} RunTime", run_seconds(record), "left before srun")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("where", choices=["local", "cluster"])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from jobgen.cli.tinymodel import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="jobgen-bench-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model")
        try:
            (local if args.where == "local" else cluster)(work, model)
        finally:
            cancel_submitted()


if __name__ == "__main__":
    main()
