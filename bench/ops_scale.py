"""What the read-side commands cost as a run grows long and a runs root fills up (issue 33).

Builds synthetic run directories (no Slurm job, no trainer: the records a week of training
leaves) and times each command as a user runs it, a fresh process each time, with its peak RSS
(GNU time's maximum resident set size of that process alone); a later look's figure is the
median of three runs:

1. **One run, 10k / 100k / 1M logged steps** (a task of 2,000 steps each, an evaluation every
   500, a checkpoint or two): ``jobgen status RUN``, ``status RUN --json``, the watchdog checks
   ``running``, ``hang``, ``memory``, ``disk``, ``jobgen plot RUN -o``, ``jobgen compare RUN -o``,
   ``jobgen logs RUN`` (its last 1000 lines) and ``jobgen samples RUN`` (the last 10 evaluations).
   ``status RUN`` is timed *first* (no summary kept yet: it reads the whole file once and keeps
   the summary beside it, as the first look after an upgrade would); then every command, each
   after 1,000 more lines were appended (as a run goes on between two looks: the summary is
   brought up to date with those only).
2. **A runs root of 10 / 100 / 1000 runs** (1,000 steps each, each with a submission Slurm no
   longer knows): ``jobgen status`` (the listing), then.
3. **A sweep of 200 points**: ``jobgen status SWEEP``.

Slurm: with the dev cluster up (``jobgen cluster up``), the listings ask it as on a cluster
(squeue and sacct for ids it does not know); without it they say Slurm is out of reach and
show what the run directories record.

    .venv/bin/python bench/ops_scale.py --work DIR [--steps 10000,100000,1000000] [--runs 10,100,1000]

Prints one table (seconds, peak MiB) and writes ``DIR/ops_scale.json``. On this 2-core machine
the 1M-step directory takes about a minute to write; the whole bench about 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import VENV_BIN, write_spec
from jobgen.runs.rundir import RunDir
from jobgen.spec.loader import load_run

T0 = 1_780_000_000.0
STEP_SECONDS = 2.0
TASK_STEPS = 2000
EVAL_EVERY = 500


def spec_text(name: str, root: Path, steps: int) -> str:
    return f"""
        site = "local"
        [job]
        name = "{name}"
        time = "1h"
        exit_grace = "2m"
        runs_root = "{root}"
        program = "train"
        [model]
        path = "model"
        [data]
        path = "data.jsonl"
        [train]
        max_steps = {steps + 1000}
        [eval]
        path = "data.jsonl"
        every_steps = {EVAL_EVERY}
    """


def make_run(work: Path, root: Path, name: str, steps: int, job_base: int = 5000) -> RunDir:
    """A run of ``steps`` logged steps in tasks of TASK_STEPS, as its trainer leaves it."""
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "data.jsonl").write_text('{"text": "a"}\n')
    spec = load_run(write_spec(work, spec_text(name, root, steps), name=f"{name}.toml"))
    run = RunDir(spec.run_dir)
    run.path.mkdir(parents=True)
    run.spec_file.write_text(json.dumps(spec.to_json()))
    (run.path / "logs").mkdir()
    tasks = max(1, steps // TASK_STEPS)
    run.record_job({"job_id": job_base, "array": tasks})
    with open(run.metrics, "w") as metrics, open(run.task_lines, "w") as task_lines:
        for task in range(tasks):
            job = f"{job_base}_{task + 1}"
            first = task * TASK_STEPS + 1
            last = steps if task == tasks - 1 else (task + 1) * TASK_STEPS
            start = T0 + first * STEP_SECONDS
            task_lines.write(
                json.dumps({"time": start, "event": "first_step", "job_id": job, "restart": 0,
                            "array_job_id": job_base, "array_task": task + 1, "start_step": first - 1,
                            "job_start": start - 30, "world_size": 8, "global_batch": 64}) + "\n"
            )  # fmt: skip
            metrics.writelines(_lines(job, first, last))
            _write_logs(run, name, job_base * 1000 + task + 1, first, last)
            end = T0 + last * STEP_SECONDS
            task_lines.write(
                json.dumps({"time": end + 5, "event": "exit", "job_id": job, "restart": 0, "start_step": first - 1,
                            "end_step": last, "exit_code": 0, "job_start": start - 30,
                            "step_seconds_total": (last - first + 1) * STEP_SECONDS, "step_seconds_max": 2.5,
                            "save_seconds": [4.0], "exit_reason": "time limit"}) + "\n"
            )  # fmt: skip
    for step in (steps - TASK_STEPS, steps):
        checkpoint = run.checkpoints / f"step_{max(step, 1):08d}"
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "trainer_state.json").write_text("{}")
    return run


def _write_logs(run: RunDir, name: str, job_id: int, first: int, last: int) -> None:
    """A task's batch log (jobgen's lines, torchrun's teed copies of rank 0's) and rank 0's own
    log, a line per step; with [eval] prompts, samples.jsonl's lines of each evaluation."""
    stamp = lambda at: time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at))  # noqa: E731
    steps = [(step, T0 + step * STEP_SECONDS) for step in range(first, last + 1)]
    lines = [f"{stamp(at)} trainer[0] INFO step {step} loss 2.5 lr 1e-4 tok/s 51234\n" for step, at in steps]
    begin, end = stamp(T0 + first * STEP_SECONDS - 30), stamp(T0 + last * STEP_SECONDS + 5)
    with open(run.batch_log(name, job_id), "w") as fh:
        fh.write(f"{begin} jobgen: job {job_id} on node[1-2]\n")
        fh.writelines(f"[default0]:{line}" for line in lines)
        fh.write(f"{end} jobgen: program exited with status 0\n")
    rank = run.rank_logs(job_id, "node1") / f"{job_id}_x" / "attempt_0" / "0"
    rank.mkdir(parents=True)
    (rank / "stdout.log").write_text("".join(lines))
    (rank / "stderr.log").write_text("")
    ended = T0 + last * STEP_SECONDS + 5
    for path in (run.batch_log(name, job_id), rank / "stdout.log", rank / "stderr.log"):
        os.utime(path, (ended, ended))  # each file last written when its task ended, as on a cluster
    with open(run.samples, "a") as fh:
        for step, _ in steps[EVAL_EVERY - first % EVAL_EVERY :: EVAL_EVERY]:
            for prompt in ("Name three colors.", "What is 2+2?", "Write a haiku about Slurm."):
                fh.write(json.dumps({"step": step, "prompt": prompt, "completion": "red, green, blue " * 4}) + "\n")


def _lines(job: str, first: int, last: int):
    for step in range(first, last + 1):
        at = T0 + step * STEP_SECONDS
        loss = 3.0 / (1 + step / 5000) + (step * 7919 % 97) / 1000
        yield (
            f'{{"time": {at:.3f}, "job_id": "{job}", "restart": 0, "step": {step}, "loss": {loss:.5f}, '
            f'"lr": 0.0001, "grad_norm": 1.25, "tokens_per_s": 51234.5, "step_seconds": {STEP_SECONDS}, '
            f'"step_tokens": 131072, "host_used_percent": 41.5, "world_size": 8}}\n'
        )
        if step % EVAL_EVERY == 0:
            yield (
                f'{{"time": {at + 1:.3f}, "job_id": "{job}", "restart": 0, "step": {step}, "event": "eval", '
                f'"eval_loss": {loss + 0.1:.5f}, "eval_ppl": 20.5, "eval_tokens": 65536, "eval_seconds": 12.5}}\n'
            )


def append_steps(run: RunDir, count: int) -> None:
    """``count`` more steps of the last task, as the run goes on between two looks."""
    with open(run.metrics, "rb") as fh:
        fh.seek(max(0, run.metrics.stat().st_size - 4096))
        last = json.loads(fh.read().rsplit(b"\n", 2)[-2])
    with open(run.metrics, "a") as fh:
        fh.writelines(_lines(str(last["job_id"]), int(last["step"]) + 1, int(last["step"]) + count))


def measure(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit status) of one command, a fresh process. GNU time
    measures the peak: a child forked from this process would count pages it shares with it."""
    report = cwd / ".time"
    proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", str(report), *argv], env=env, cwd=cwd,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)  # fmt: skip
    seconds, kib = report.read_text().split()[-2:]
    return float(seconds), int(kib) / 1024, proc.returncode


def run_commands(run: RunDir, out: Path) -> dict[str, list[str]]:
    jobgen = str(VENV_BIN / "jobgen")
    return {
        "status RUN": [jobgen, "status", str(run.path)],
        "status RUN --json": [jobgen, "status", str(run.path), "--json"],
        "watchdog running": [jobgen, "watchdog", "run", "running", str(run.path)],
        "watchdog hang": [jobgen, "watchdog", "run", "hang", str(run.path)],
        "watchdog memory": [jobgen, "watchdog", "run", "memory", str(run.path)],
        "watchdog disk": [jobgen, "watchdog", "run", "disk", str(run.path)],
        "plot -o": [jobgen, "plot", str(run.path), "-o", str(out / "plot.png")],
        "compare -o": [jobgen, "compare", str(run.path), "-o", str(out / "compare.png")],
        "logs": [jobgen, "logs", str(run.path)],
        "samples": [jobgen, "samples", str(run.path)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", default="10000,100000,1000000")
    parser.add_argument("--runs", default="10,100,1000")
    parser.add_argument("--sweep-points", type=int, default=200)
    args = parser.parse_args()
    work = args.work.absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # Timed as installed: Python's cached bytecode, not a recompile of ~60 modules per command
    # (PYTHONDONTWRITEBYTECODE in the caller's environment made every figure ~0.08 s higher).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"HF_HUB_OFFLINE": "1"}
    package = Path(__file__).resolve().parents[1] / "jobgen"
    subprocess.run([str(VENV_BIN / "python"), "-m", "compileall", "-q", str(package)], env=env, check=True)
    results: list[dict] = []

    def record(what: str, size: str, phase: str, argv: list[str], env: dict[str, str] = env) -> None:
        # A first look is one run (it keeps the summary); a later one the median of three.
        runs = [measure(argv, env, work) for _ in range(1 if phase == "first" else 3)]
        seconds = statistics.median(r[0] for r in runs)
        mib, code = max(r[1] for r in runs), max(r[2] for r in runs)
        results.append({"command": what, "size": size, "phase": phase, "seconds": round(seconds, 3),
                        "peak_mib": round(mib, 1), "exit": code})  # fmt: skip
        print(f"{what:22} {size:>10} {phase:6} {seconds:8.2f} s {mib:8.1f} MiB  exit {code}", flush=True)

    for steps in [int(s) for s in args.steps.split(",") if s]:
        root = work / f"steps-{steps}"
        built = time.perf_counter()
        run = make_run(root, root / "runs", f"long{steps}", steps)
        size = f"{steps // 1000}k steps"
        print(f"# {size}: {run.metrics.stat().st_size / 2**20:.0f} MiB of metrics.jsonl, "
              f"written in {time.perf_counter() - built:.1f} s", flush=True)  # fmt: skip
        commands = run_commands(run, root)
        record("status RUN", size, "first", commands["status RUN"])
        for what, argv in commands.items():
            append_steps(run, 1000)
            record(what, size, "then", argv)
    for count in [int(s) for s in args.runs.split(",") if s]:
        root = work / f"root-{count}"
        for i in range(count):
            make_run(root, root / "runs", f"r{i:04d}", 1000, job_base=90000 + i * 10)
        listing = {**env, "JOBGEN_RUNS_ROOT": str(root / "runs")}
        record("status (listing)", f"{count} runs", "first", [str(VENV_BIN / "jobgen"), "status"], listing)
        record("status (listing)", f"{count} runs", "then", [str(VENV_BIN / "jobgen"), "status"], listing)
    if args.sweep_points:
        root = work / "sweep"
        sweep = root / "runs" / "sw"
        points = []
        for i in range(args.sweep_points):
            name = f"p{i:03d}"
            make_run(root, sweep / "points", name, 1000, job_base=70000)
            points.append({"name": name, "overrides": {"train.lr": 1e-4 * (i + 1)}, "program": "train", "attempts": 1})
        index = {"format": 2, "name": "sw", "max_parallel": 4, "points": points, "jobs": [{"job_id": 70000}]}
        (sweep / "sweep.json").write_text(json.dumps(index))
        listing = {**env, "JOBGEN_RUNS_ROOT": str(root / "runs")}
        size = f"{args.sweep_points} points"
        record("status SWEEP", size, "first", [str(VENV_BIN / "jobgen"), "status", "sw"], listing)
        record("status SWEEP", size, "then", [str(VENV_BIN / "jobgen"), "status", "sw"], listing)
    (work / "ops_scale.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
