"""Soak: one run on the dev cluster for a long time, through a random schedule of faults.

A 2-node run (1 process per node, gloo) saves by wall time every few seconds, runs
as a job array of short tasks that hit their time limit, and meanwhile gets, at
random moments: ``scancel --signal=USR1``, ``scontrol requeue``, the kill switch
(then a resubmission), the save switch, SIGKILL of a worker, and a hung (SIGSTOPped)
rank. At the end:

- every logged step's loss equals that of an uninterrupted run with the same seed
  (CPU runs are deterministic), the steps that were computed twice included;
- no task that followed a graceful stop recomputed a step;
- a task that followed a crash resumed from the newest checkpoint there was when the
  crash hit, so it lost at most one save interval (the seconds it recomputed are in
  the report);
- every checkpoint on disk loads, none was set aside, the run is not marked failed.

``pytest -n 0 -m soak tests/soak/test_soak.py -s`` runs the 30-minute soak
(``JOBGEN_SOAK_MINUTES`` changes its length, ``JOBGEN_SOAK_SEED`` replays a schedule);
``pytest -m full tests/soak/test_soak.py`` runs a quick variant: each quick fault once (a task's
time limit first, then USR1, the save switch, SIGKILL and the kill switch in random
order) at shorter random moments. Both print their figures.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import (
    REPO,
    VENV_BIN,
    exit_record,
    jobgen,
    losses,
    read_jsonl,
    status,
    submit,
    train_spec,
    wait_for,
    wait_until_gone,
    worker_pids,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.lifecycle]

GRACEFUL = {ExitCode.OK, ExitCode.KILL_SWITCH, ExitCode.SIGNALLED, ExitCode.DEADLINE, ExitCode.MEMORY_GUARD}
SAVE_EVERY_S = 4
SETTINGS = {
    "save_every": f"{SAVE_EVERY_S}s",
    "save_every_steps": 0,
    "keep_checkpoints": 2,
    "seed": 11,
    "collective_timeout": "20s",
    "max_steps": 1_000_000,
    "grad_accum": 2,
}


@dataclass
class Soak:
    """The run under test and what was done to it."""

    spec: Path
    run: Path
    array: int
    array_size: int
    faults: list[tuple[float, str, int]] = field(default_factory=list)  # (time, kind, job id)
    # job id -> the newest checkpoint's step when a crash (SIGKILL, hang) was injected into it
    newest_at_crash: dict[str, int] = field(default_factory=dict)

    def running(self) -> int | None:
        """The job id of the array task that is running now, if any."""
        for entry in slurm.queue([self.array]):
            if entry.state == "RUNNING" and entry.array_task.isdigit():
                return entry.job_id
        return None

    def training_job(self, timeout: float = 420) -> int:
        """A running task that has taken a few steps and is still taking them (not hung),
        resubmitting if the array ran out."""

        def trained() -> int | None:
            job = self.running()
            mine = [r for r in read_jsonl(self.run / "metrics.jsonl") if r.get("job_id") == str(job)] if job else []
            last_fault = self.faults[-1][0] if self.faults else 0.0
            # A step logged after the last fault: this task trains (a hung one does not).
            if len(mine) >= 3 and mine[-1]["time"] > last_fault:
                return job
            if not slurm.queue([self.array]):
                self.resubmit()
            return None

        return wait_for(
            trained,
            timeout,
            lambda: f"a task of {self.array} to train; logs: {sorted(p.name for p in (self.run / 'logs').iterdir())}",
            interval=1,
        )

    def resubmit(self) -> None:
        assert not (self.run / "failed").exists(), (self.run / "failed").read_text()
        self.array = submit(self.spec, "--array", str(self.array_size))


def inject(soak: Soak, kind: str, job: int) -> None:
    soak.faults.append((time.time(), kind, job))
    print(f"soak: {time.strftime('%H:%M:%S')} {kind} on job {job}", flush=True)
    switches = soak.run / "switches"
    if kind == "usr1":
        # scancel may exit non-zero for a step that already ended (the head-address step)
        # although the training step got the signal: the outcome is judged from the run.
        subprocess.run(["scancel", "--signal=USR1", str(job)], capture_output=True)
    elif kind == "requeue":
        subprocess.run(["scontrol", "requeue", str(job)], capture_output=True)
    elif kind == "save-switch":
        (switches / "save").touch()
    elif kind == "time-limit":
        # No fault but the task's own time limit: it must save and leave before Slurm ends it.
        wait_for(lambda: soak.running() != job, 300, f"job {job} to reach its time limit", interval=1)
        # Saved and left on its own: by the deadline (end time - exit_grace) or by the
        # batch shell's lead-time signal, never cut by Slurm at the limit.
        done = wait_for(lambda: exit_record(soak.run, job), 60, f"job {job}'s exit record")
        assert done["exit_code"] in (ExitCode.DEADLINE, ExitCode.SIGNALLED), done
        # Either way the reason names the time limit ("time limit near (deadline: ...)" or
        # "time limit (USR1 45 s before the limit)"), not a bare stop request.
        assert done["exit_reason"].startswith("time limit"), done
    elif kind == "kill-switch":
        (switches / "kill").touch()
        wait_until_gone([soak.array], timeout=300)
        (switches / "kill").unlink()
        soak.resubmit()
    elif kind in ("sigkill", "hang"):
        pids = worker_pids(soak.run)
        if pids:
            saved = [int(p.name.split("-")[1]) for p in (soak.run / "checkpoints").glob("step-*")]
            soak.newest_at_crash[str(job)] = max(saved, default=0)
            os.kill(random.choice(pids), signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
        if pids and kind == "hang" and not IN_JOB_RESTARTS:
            release_after_hang(soak)


def quarantined(run: Path) -> list[str]:
    path = run / "quarantine.json"
    return sorted(json.loads(path.read_text()).get("nodes", {})) if path.exists() else []


def release_after_hang(soak: Soak) -> None:
    """Without the hang watch, the stopped rank's peer waits out the collective timeout and
    the stopped rank's node is quarantined (it went silent). The node is not broken: as a
    person would, the soak has the doctor check it and release it, so that a later hang
    does not leave the run too few nodes."""
    nodes = wait_for(lambda: quarantined(soak.run) or None, 120, "the silent rank's node to be quarantined")
    print(f"soak: {time.strftime('%H:%M:%S')} releasing {nodes} with jobgen doctor --clear", flush=True)
    jobgen("doctor", "--clear", str(soak.run), check=True, timeout=400)
    assert not quarantined(soak.run), quarantined(soak.run)


def attempts(run: Path) -> list[dict]:
    """Every attempt (each launch of one, with job.in_job_restarts) that trained, in order:
    start and end step, exit code (None: killed)."""
    out: dict[tuple[str, int, int], dict] = {}
    for r in read_jsonl(run / "tasks.jsonl"):
        key = (r["job_id"], r.get("restart", 0), r.get("launch", 0))
        entry = out.setdefault(key, {"job_id": r["job_id"], "restart": key[1], "launch": key[2], "exit_code": None})
        if r["event"] == "first_step":
            entry.update(start_step=r["start_step"], started=r["time"])
        elif r["event"] == "exit":
            entry.update(exit_code=r["exit_code"], end_step=r["end_step"])
            entry.setdefault("start_step", r.get("start_step"))
    lines = read_jsonl(run / "metrics.jsonl")
    for (job, restart, launch), entry in out.items():
        mine = [m for m in lines if (m["job_id"], m.get("restart", 0), m.get("launch", 0)) == (job, restart, launch)]
        entry["lines"] = mine
        if entry.get("end_step") is None and mine:
            entry["end_step"] = max(m["step"] for m in mine)
    return sorted((e for e in out.values() if e.get("start_step") is not None), key=lambda e: e["started"])


def reference_losses(
    spec_dir: Path, tiny_model: Path, until: int, omp_threads: str, settings: dict[str, object] = SETTINGS
) -> dict[int, float]:
    """The same run, uninterrupted, on this machine (2 processes, gloo, the soak's OpenMP
    thread count: CPU kernels may split reductions by thread), up to step ``until``."""
    ref_spec = train_spec(spec_dir, tiny_model, "soak-reference", nodes=1, **settings)
    proc = jobgen("validate", str(ref_spec))
    assert proc.returncode == 0, proc.stderr
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    spec = load_run(ref_spec)
    run, _ = materialize(spec, render(spec), ref_spec.read_text())
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "trainer",
        "--run-dir",
        str(run.path),
        "--expected-world-size",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": omp_threads, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    worker = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(
            lambda: max(losses(run.path), default=0) >= until,
            24 * 3600,
            f"the reference run's step {until}",
            process=worker,
        )
        (run.switches / "kill").touch()
        worker.wait(timeout=300)
    finally:
        if worker.poll() is None:
            worker.kill()
    return losses(run.path)


def check_checkpoints_load(run: Path) -> list[str]:
    """Every complete checkpoint reads back whole: every tensor of model and optimizer
    (DCP), the trainer state, every rank's RNG file without unpickling objects."""
    names = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    code = f"""
import json, sys, tempfile, os
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
root = {str(run / "checkpoints")!r}
for name in {names!r}:
    path = os.path.join(root, name)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "all.pt"))
    json.load(open(os.path.join(path, "trainer_state.json")))
    for rank in (0, 1):
        torch.load(os.path.join(path, f"rng-rank{{rank:05d}}.pt"), weights_only=True)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    return names


LONG_MINUTES = float(os.environ.get("JOBGEN_SOAK_MINUTES", "30"))
# JOBGEN_SOAK_IN_JOB_RESTARTS=N: the same soak with job.in_job_restarts = N and hangs found
# inside the job (train.hang_timeout, under the soak's collective timeout), to compare its
# goodput with the requeue path's at the same seed (BENCHMARKS.md).
IN_JOB_RESTARTS = int(os.environ.get("JOBGEN_SOAK_IN_JOB_RESTARTS", "0"))
IN_JOB = {"job": {"in_job_restarts": IN_JOB_RESTARTS}, "hang_timeout": "12s"} if IN_JOB_RESTARTS else {}


# The time limits: the faults' minutes plus the last task, the reference run and the checks.
# minutes=None is the quick variant: every quick fault once, then the checks (about 6 minutes).
@pytest.mark.parametrize(
    "minutes",
    [
        pytest.param(None, id="quick", marks=[pytest.mark.timeout(1200)]),  # in CI: every quick fault once
        pytest.param(LONG_MINUTES, id="long", marks=[pytest.mark.soak, pytest.mark.timeout(LONG_MINUTES * 60 + 1800)]),
    ],
)
def test_soak(cluster_run, tmp_path, tiny_model, minutes):
    seed = int(os.environ.get("JOBGEN_SOAK_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    quick = minutes is None
    # Requeued jobs wait ~2 minutes here before they start again; hangs cost the
    # collective timeout plus KillWait: the quick variant keeps to the quick faults.
    kinds = ["time-limit", "usr1", "save-switch", "sigkill", "kill-switch"] + ([] if quick else ["requeue", "hang"])
    array_size = 6 if quick else max(6, int(minutes))
    # A moment inside a task: after a few steps and saves (one save every 4 s).
    moment = (3, 10) if quick else (5, 25)
    spec, run = cluster_run(
        "soak",
        nodes=2,
        procs_per_node=1,
        time_limit="2m",
        grace="45s",
        array=array_size,
        **SETTINGS,
        **IN_JOB,
    )
    label = "quick" if quick else f"{minutes} min"
    print(f"soak: {label}, seed {seed} (JOBGEN_SOAK_SEED={seed} replays it), faults {kinds}", flush=True)
    soak = Soak(spec, run, submit(spec), array_size)
    started = time.monotonic()
    order = kinds[1:]
    rng.shuffle(order)
    order.insert(0, "time-limit")  # first, so that a task reaches its limit in every variant

    def more() -> bool:
        return i < len(order) if quick else time.monotonic() - started < minutes * 60

    i = 0
    while more():
        job = soak.training_job()
        time.sleep(rng.uniform(*moment))
        if not quick and not more():
            break
        if soak.running() != job:  # the task ended meanwhile (its time limit): a fault of its own
            continue
        # Every kind once before any repeats, then at random.
        kind = order[i] if i < len(order) else rng.choice(kinds)
        i += 1
        inject(soak, kind, job)
    soak.training_job()
    (run / "switches" / "kill").touch()
    wait_until_gone([soak.array], timeout=400)

    tried = attempts(run)
    final = max(a["end_step"] for a in tried)
    (threads,) = re.findall(r"^export OMP_NUM_THREADS=(\d+)$", (run / "train.sbatch").read_text(), re.M)
    reference = reference_losses(tmp_path / "reference", tiny_model, final, threads)
    mismatched = [
        (a["job_id"], m["step"], m["loss"], reference.get(m["step"]))
        for a in tried
        for m in a["lines"]
        if reference.get(m["step"]) is None or abs(m["loss"] - reference[m["step"]]) > 1e-5
    ]
    assert not mismatched, mismatched[:10]

    crash_redone, crash_seconds_lost, crashes = [], [], 0
    for prev, nxt in itertools.pairwise(tried):
        redone = prev["end_step"] - nxt["start_step"]
        if prev["exit_code"] in GRACEFUL:
            assert redone == 0, (prev, nxt)
            continue
        crashes += 1
        crash_redone.append(redone)
        # Lost work is bounded by the save interval: the next task resumed from the newest
        # checkpoint there was when the crash hit (or a newer one the crash did not cut).
        if prev["job_id"] in soak.newest_at_crash:
            assert nxt["start_step"] >= soak.newest_at_crash[prev["job_id"]], (prev, nxt, soak.newest_at_crash)
        after = [m for m in prev["lines"] if m["step"] >= nxt["start_step"]]
        crash_seconds_lost.append(round(after[-1]["time"] - after[0]["time"], 1) if after else 0.0)
    names = check_checkpoints_load(run)
    assert not list((run / "checkpoints").glob("broken-*")) and not (run / "failed").exists()
    view = status(run)
    kinds_done: dict[str, int] = {}
    for _, kind, _ in soak.faults:
        kinds_done[kind] = kinds_done.get(kind, 0) + 1
    exits: dict[str, int] = {}
    for a in tried:
        how = "killed" if a["exit_code"] is None else ExitCode(a["exit_code"]).name.lower()
        exits[how] = exits.get(how, 0) + 1
    report = {
        "minutes": label,
        "seed": seed,
        "in_job_restarts": IN_JOB_RESTARTS,
        "relaunches": sum(1 for a in tried if a["launch"]),
        "final_step": final,
        "attempts": len(tried),
        "faults": kinds_done,
        "exits": exits,
        "crashes": crashes,
        "steps_recomputed_after_crashes": crash_redone,
        "seconds_recomputed_after_crashes": crash_seconds_lost,
        "save_every_seconds": SAVE_EVERY_S,
        "steps_recomputed_after_graceful_stops": 0,
        "goodput": view["goodput"],
        "checkpoints_verified": names,
        "losses_compared": sum(len(a["lines"]) for a in tried),
    }
    print("soak report: " + json.dumps(report), flush=True)
    if os.environ.get("JOBGEN_SOAK_REPORT"):
        Path(os.environ["JOBGEN_SOAK_REPORT"]).write_text(json.dumps(report, indent=2) + "\n")
    assert len(soak.faults) >= len(kinds), kinds_done
    assert "time-limit" in kinds_done, kinds_done
