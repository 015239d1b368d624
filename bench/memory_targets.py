"""Memory of real model sizes on CPU: the trainer's measured peaks against the targets and
against ``jobgen plan``'s prediction.

A randomly initialised 374M-parameter Llama (hidden 1024, 24 layers, intermediate 2816,
vocabulary 32000, untied: 1.39 GiB of fp32 weights) is trained for a few steps by the
real trainer (``torchrun -m trainer``), and exported by ``jobgen export``:

- ``fsdp``: FSDP2 on 2 ranks, AdamW. Targets per rank: loading at most weights/2 + 768 MiB,
  training at most 4 x weights/2 + 1.5 GiB.
- ``lean``: one process, Adafactor, optimizer in backward, gradient checkpointing, chunked
  loss. Target: at most weights + 1 GiB.
- ``export``: the fsdp run's checkpoint to safetensors. Target: at most weights/2 + 768 MiB.

Peaks are each rank's peak resident set per phase, as the trainer records them in
``metrics.json`` (``memory_peaks``: load, first_step, steady; the largest over ranks), and
the export process's peak RSS. ``jobgen plan`` is asked for the same runs; the ratio
plan/measured should lie within 0.8-1.2. About 15 minutes on 2 CPU cores, 12 GiB free:

    .venv/bin/python bench/memory_targets.py [--work DIR] [--steps 3]

Prints one line per figure and writes them to ``DIR/memory_targets.json``. Pass
``--small`` for a 30M model that checks the script itself in a minute (no targets).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_run import prepared_run, train

from helpers import DATA, REPO, VENV_BIN

MIB = 2**20
# jobgen.cli.tinymodel.make_tiny_model's keywords.
FULL = {
    "hidden_size": 1024,
    "layers": 24,
    "intermediate_size": 2816,
    "heads": 16,
    "kv_heads": 16,
    "model_vocab_size": 32000,
}
SMALL = {
    "hidden_size": 256,
    "layers": 4,
    "intermediate_size": 704,
    "heads": 4,
    "kv_heads": 4,
    "model_vocab_size": 32000,
}


def build_model(target: Path, shape: dict[str, int]) -> int:
    """A random Llama of ``shape`` with a locally trained tokenizer; returns its weight bytes."""
    from jobgen.cli.tinymodel import make_tiny_model
    from jobgen.model.files import read_model

    if not (target / "config.json").exists():
        make_tiny_model(target, **shape, max_shard_size="500MB")
    return read_model(target).param_count * 4  # trained in fp32 on CPU


def make(work: Path, name: str, model: Path, procs: int, model_keys: dict, train_keys: dict) -> tuple[Path, Path]:
    """A run directory as ``jobgen submit`` writes it, and its spec file."""
    return prepared_run(
        work,
        name,
        procs=procs,
        model={"path": model, **model_keys},
        data={"path": DATA, "max_length": 256, "packing": True},
        # The lean allocator, as "auto" chooses it when memory is tight: on this machine the
        # runs have room, and "auto" would measure glibc's heaps instead.
        train={
            "micro_batch_size": 1,
            "grad_accum": 1,
            "lr": 1e-4,
            "log_every_steps": 1,
            "seed": 1,
            "host_allocator": "lean",
            **train_keys,
        },
    )


def plan(spec_file: Path) -> dict:
    proc = subprocess.run(
        [str(VENV_BIN / "jobgen"), "plan", str(spec_file), "--json"], capture_output=True, text=True, check=False
    )
    if proc.returncode not in (0, 1):
        raise SystemExit(f"jobgen plan failed: {proc.stderr}")
    return json.loads(proc.stdout)


def trained_peaks(run: Path, procs: int) -> dict:
    """Trains ``run``; the memory peaks it recorded (each phase's largest over the ranks)."""
    train(run, procs, timeout=3600)
    peaks = json.loads((run / "metrics.json").read_text())["memory_peaks"]
    return peaks.get("max_over_ranks") or peaks  # each phase's largest figure over the ranks


def export_peak(run: Path, target: Path) -> float:
    """Peak RSS (MiB) of ``jobgen export`` in a child process of its own."""
    code = (
        "import resource, subprocess, sys; "
        "proc = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
        "sys.exit(proc.returncode)"
    )
    cmd = [sys.executable, "-c", code, str(VENV_BIN / "jobgen"), "export", str(run), "--to", str(target)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"export failed:\n{proc.stdout}\n{proc.stderr[-5000:]}")
    return int(proc.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--small", action="store_true", help="a 30M model: checks the script, no targets")
    parser.add_argument("--only", choices=["fsdp", "lean"], help="one of the two runs (fsdp includes the export)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="jobgen-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / ("model-small" if args.small else "model-374m")
    weights = build_model(model, SMALL if args.small else FULL) / MIB
    print(f"model {model}: {weights:.0f} MiB of fp32 weights", flush=True)
    steps = {"max_steps": args.steps, "save_every_steps": 0}
    rows = []

    def row(what: str, measured: float, target: float | None, predicted: float | None) -> None:
        ratio = predicted / measured if predicted else None
        ok = "" if target is None or args.small else ("within target" if measured <= target else "OVER TARGET")
        rows.append({"what": what, "measured_mib": measured, "target_mib": target, "plan_mib": predicted})
        print(
            f"{what:<34} measured {measured:8.0f} MiB"
            + (f"   target {target:8.0f} MiB {ok}" if target else "")
            + (f"   plan {predicted:8.0f} MiB (plan/measured {ratio:.2f})" if predicted else ""),
            flush=True,
        )

    if args.only != "lean":
        fsdp_and_export(work, model, weights, steps, row)
    if args.only != "fsdp":
        lean_run(work, model, weights, steps, row)
    (work / "memory_targets.json").write_text(json.dumps({"weights_mib": weights, "rows": rows}, indent=2) + "\n")
    print(f"written {work / 'memory_targets.json'}")


def fsdp_and_export(work: Path, model: Path, weights: float, steps: dict, row) -> None:
    run, spec_file = make(work, "fsdp", model, 2, {}, {"parallelism": "fsdp", "optimizer": "adamw", **steps})
    predicted = plan(spec_file)
    peaks = trained_peaks(run, 2)
    row("fsdp 2 ranks adamw: load", peaks["load"]["host_rss_peak_mib"], weights / 2 + 768, _phase(predicted, "load"))
    trained = max(peaks["first_step"]["host_rss_peak_mib"], peaks["steady"]["host_rss_peak_mib"])
    row("fsdp 2 ranks adamw: train", trained, 4 * weights / 2 + 1536, _phase(predicted, "train"))
    row("export (fsdp checkpoint)", export_peak(run, work / "exported-fsdp"), weights / 2 + 768, None)


def lean_run(work: Path, model: Path, weights: float, steps: dict, row) -> None:
    lean_train = {"optimizer": "adafactor", "optimizer_in_backward": True, "grad_clip": 0.0, **steps}
    run, spec_file = make(work, "lean", model, 1, {"gradient_checkpointing": True}, lean_train)
    predicted = plan(spec_file)
    peaks = trained_peaks(run, 1)
    lean = max(peaks[phase]["host_rss_peak_mib"] for phase in ("load", "first_step", "steady"))
    row("1 process adafactor+oib+ckpt", lean, weights + 1024, _phase(predicted, "train"))


def _phase(predicted: dict, phase: str) -> float | None:
    """The plan's predicted peak (MiB) for ``phase`` ("load" or "train"), if it gives one."""
    phases = predicted.get("phases") or {}
    if not phases:
        return None
    figure = phases["load"] if phase == "load" else max(phases["first_step"], phases["steady"])
    return figure / MIB


if __name__ == "__main__":
    main()
