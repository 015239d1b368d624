"""The hour soak (issue 47): one run on the dev cluster for an hour with a fault every 10 minutes,
recovered inside the job by its supervisor, and the goodput `jobgen status` reports for it.

A 2-node run (1 process per node, gloo, the tiny model, steps paced to STEP_SECONDS) with a
spare node (job.spare_nodes = 1), relaunches inside the task (job.in_job_restarts), in-memory
snapshots every few steps and the hang watch (train.hang_timeout), with SlurmdTimeout at Slurm's
default of 300 s. At minutes 10, 20, 30, 40 and 50 of the hour:

- SIGKILL of a rank (the supervisor relaunches from the newest snapshot);
- a hung rank (SIGSTOP: the hang watch takes the stacks, kills the launch, relaunches);
- a node lost (every process of its network namespace killed, its slurmd with them: the
  supervisor finds it, quarantines it and relaunches on the spare; the node is brought back as
  a repaired machine would be, and stays quarantined for this run);
- the task's time limit (its deadline is set to fall there: it saves and the next array task
  resumes);
- SIGKILL of a rank again;

then the kill switch at the hour. At the end every logged loss equals an uninterrupted run's
(the same seed on 2 processes), every checkpoint loads, the run is not failed, and the goodput of
`jobgen status` is at least 97 %. The wall-clock share of the hour spent on kept steps is reported
beside it (it also counts the seconds between a fault and the relaunch's start).

    .venv/bin/python -m pytest -n 0 -m soak tests/soak/test_soak_hour.py -s

``JOBGEN_SOAK_HOUR_MINUTES`` shortens the hour for a trial (the faults keep their order and
spacing of a sixth of it), ``JOBGEN_SOAK_REPORT`` writes the report as JSON.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
from test_soak import attempts, check_checkpoints_load, reference_losses

from helpers import (
    exit_record,
    kill_node,
    read_jsonl,
    revive_node,
    running_task,
    slurm_setting,
    status,
    submit,
    wait_for,
    wait_until_gone,
    worker_pids,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.runs.goodput import run_reports
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.lifecycle, pytest.mark.soak]

MINUTES = float(os.environ.get("JOBGEN_SOAK_HOUR_MINUTES", "60"))
FAULTS = ["sigkill", "hang", "lost-node", "time-limit", "sigkill"]
GRACE_SECONDS = 60
# A step of a second: the order of a fine-tuning step on GPUs (the tiny model's own step on
# this machine is about 0.1 s). What a fault costs does not depend on it (detection, the
# relaunch's start, about half a snapshot interval of steps redone); what every step costs
# at its boundary does, and weighs 2.5 times more at the other scenarios' 0.4 s (the hour at
# 0.4 s measured 96.5 %, BENCHMARKS.md).
STEP_SECONDS = 1.0
# The trainer's settings, the reference run's too (snapshots and the hang watch change no loss).
SETTINGS = {
    "save_every": "5m",
    "save_every_steps": 0,
    "keep_checkpoints": 2,
    "seed": 11,
    "collective_timeout": "30s",
    "max_steps": 1_000_000,
}
RECOVERY = {"snapshot_every_steps": 5, "hang_timeout": "10s"}


def launch_nodes(run: Path) -> list[str]:
    """The nodes the run's ranks are on now (their SLURMD_NODENAME)."""
    nodes = set()
    for pid in worker_pids(run):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        nodes |= {e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SLURMD_NODENAME=")}
    return sorted(nodes)


def relaunches(log: Path) -> int:
    return sum("relaunching the program" in line for line in log.read_text().splitlines()) if log.exists() else 0


def trains_again(run: Path, after: float, timeout: float = 240) -> float:
    """When the first step after ``after`` (a fault) was logged."""

    def stepped() -> float | None:
        later = [r["time"] for r in read_jsonl(run / "metrics.jsonl") if r["time"] > after and "loss" in r]
        return min(later) if later else None

    return wait_for(stepped, timeout, "a step after the fault", interval=1)


def inject(kind: str, run: Path, task: int, cluster, rng: random.Random) -> dict[str, object]:
    """One fault; returns what was done and when the run trained again."""
    at = time.time()
    log = run / "logs" / f"{run.name}-{task}.out"
    before = relaunches(log)
    done: dict[str, object] = {"fault": kind, "time": time.strftime("%H:%M:%S"), "job": task}
    print(f"soak-hour: {done['time']} {kind} on job {task}", flush=True)
    if kind in ("sigkill", "hang"):
        victim = rng.choice(worker_pids(run))
        os.kill(victim, signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
        wait_for(lambda: relaunches(log) > before, 120, f"the relaunch after the {kind}", interval=1)
    elif kind == "lost-node":
        batch_host = slurm.hostnames(slurm.show_job(task)[0]["BatchHost"])[0]
        (victim,) = [n for n in launch_nodes(run) if n != batch_host]
        done["node"] = victim
        kill_node(victim)
        try:
            wait_for(lambda: relaunches(log) > before, 120, "the relaunch after the lost node", interval=1)
        finally:
            revive_node(cluster, victim)  # repaired; the run keeps it quarantined
    elif kind == "time-limit":
        # No fault of ours: the task's deadline (time limit less exit_grace) falls here.
        record = wait_for(lambda: exit_record(run, task), 3 * GRACE_SECONDS, f"job {task}'s exit at its deadline")
        assert record["exit_code"] in (ExitCode.DEADLINE, ExitCode.SIGNALLED), record
        assert record["exit_reason"].startswith("time limit"), record
        at = time.time()  # from the old task's end: its own steps came before
    done["seconds_to_next_step"] = round(trains_again(run, at) - at, 1)
    return done


# The hour, then the uninterrupted reference run and the checks (pytest-timeout's default is 10 minutes).
@pytest.mark.timeout(MINUTES * 60 + 1800)
def test_an_hour_with_a_fault_every_ten_minutes(cluster, cluster_run, tmp_path, tiny_model):
    seed = int(os.environ.get("JOBGEN_SOAK_SEED", "47"))
    rng = random.Random(seed)
    every = MINUTES * 60 / (len(FAULTS) + 1)
    # The first task's deadline falls at the time-limit fault (its 4th), the second runs past the end.
    limit = math.ceil((FAULTS.index("time-limit") + 1) * every / 60 + GRACE_SECONDS / 60)
    spec, run = cluster_run(
        "hour",
        nodes=2,
        procs_per_node=1,
        time_limit=f"{limit}m",
        grace=f"{GRACE_SECONDS}s",
        array=2,
        job={"in_job_restarts": 8, "spare_nodes": 1},
        pace=STEP_SECONDS,
        **SETTINGS,
        **RECOVERY,
    )
    print(f"soak-hour: {MINUTES:g} min, a fault every {every:.0f} s: {FAULTS}, seed {seed}", flush=True)
    faults = []
    with slurm_setting("SlurmdTimeout", "300"):
        array = submit(spec)
        began = time.time()
        for k, kind in enumerate(FAULTS, 1):
            task = running_task(array, 2 if k > FAULTS.index("time-limit") + 1 else 1, timeout=300)
            time.sleep(max(0.0, began + k * every - time.time()))
            faults.append(inject(kind, run, task, cluster, rng))
        time.sleep(max(0.0, began + MINUTES * 60 - time.time()))
        (run / "switches" / "kill").touch()
        wait_until_gone([array], timeout=400)
    ended = time.time()

    tried = attempts(run)
    final = max(a["end_step"] for a in tried)
    (threads,) = re.findall(r"^export OMP_NUM_THREADS=(\d+)$", (run / "train.sbatch").read_text(), re.M)
    reference = reference_losses(tmp_path / "reference", tiny_model, final, threads, SETTINGS)
    logged = [(a["job_id"], m["step"], m["loss"]) for a in tried for m in a["lines"]]
    mismatched = [(j, s, x, reference.get(s)) for j, s, x in logged if abs(x - reference.get(s, math.inf)) > 1e-5]
    assert not mismatched, mismatched[:10]
    names = check_checkpoints_load(run)
    assert not list((run / "checkpoints").glob("broken-*")) and not (run / "failed").exists()

    view = status(run)
    quarantine = run / "quarantine.json"
    kept = sum(r.useful_seconds or 0.0 for r in run_reports(run))
    report = {
        "minutes": MINUTES,
        "seed": seed,
        "step_seconds": STEP_SECONDS,
        "faults": faults,
        "attempts": len(tried),
        "relaunches": sum(1 for a in tried if a["launch"]),
        "final_step": final,
        "goodput": view["goodput"],
        "kept_step_seconds_over_wall": round(kept / (ended - began), 4) if kept else None,
        "losses_compared": len(logged),
        "checkpoints_verified": names,
        "quarantined": sorted(json.loads(quarantine.read_text()).get("nodes", {})) if quarantine.exists() else [],
    }
    print("soak-hour report: " + json.dumps(report), flush=True)
    if os.environ.get("JOBGEN_SOAK_REPORT"):
        Path(os.environ["JOBGEN_SOAK_REPORT"]).write_text(json.dumps(report, indent=2) + "\n")
    assert [f["fault"] for f in faults] == FAULTS
    # The lost node was found lost (quarantined, the relaunch on the spare), not taken for a hang.
    assert report["quarantined"] == [f["node"] for f in faults if f["fault"] == "lost-node"], report
    assert view["goodput"] >= 0.97, report
