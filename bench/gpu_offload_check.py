"""GPU check of FSDP2's CPU offload (``train.cpu_offload``): a 1.1B Llama trained with and
without it, the GPU memory ``jobgen plan`` predicts next to what was measured.

A randomly initialised Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, intermediate
5632, 32 heads, 4 KV heads, vocabulary 32000; built from a config on the GPU, nothing
downloaded) in bf16 is trained by the real trainer for a few optimizer steps on packed
2048-token rows, micro-batch 1, AdamW, gradient checkpointing, global gradient clipping at 1.0
(``clip_grad_norm_`` over DTensor gradients that live in host memory when offloaded), twice
with the same seed and data: without and with ``train.cpu_offload``. On one GPU, one command:

    .venv/bin/python bench/gpu_offload_check.py [--procs 1] [--parallelism fsdp] [--steps 5] [--work DIR]

(``--procs 2`` needs two GPUs; ``--parallelism hsdp`` with 2 processes shards over 1 rank and
replicates twice: ``--shard-size 1``.) Prints, for each run: steps done, seconds per step,
``jobgen plan``'s (``jobgen.plan.memory_plan.plan_run``) predicted peak per GPU next to the measured
peak of ``torch.cuda.max_memory_allocated`` (the trainer's ``metrics.json`` ``memory_peaks``),
the host RSS peak, and the losses.

Checks: both runs finish every step; with offload the GPU peak is at most half the peak
without it (the parameter, gradient and optimizer-state shards are in host memory); the two
runs' losses agree within 2 % step by step (the optimizer steps on the CPU instead of the
GPU: rounding only). The plan is printed, not checked. Exit status 0 when every check holds,
1 otherwise. ``--help`` works without a GPU; the runs need one (the trainer refuses
``cpu_offload`` on a CPU). ``--smoke`` checks the script where there is none: a 4-layer model
of hidden 256 on 512-token rows, the run without offload only, on the CPU. ``--json FILE``
writes the figures and checks (bench/gpu_proofs.py reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_run import random_bf16_model, write_result

GIB = 2**30
# jobgen.cli.tinymodel.make_tiny_model's keywords: TinyLlama-1.1B's shape.
LLAMA_1B = {"hidden_size": 2048, "layers": 22, "intermediate_size": 5632, "heads": 32, "kv_heads": 4}
SMALL = {"hidden_size": 256, "layers": 4, "intermediate_size": 704, "heads": 4, "kv_heads": 2}
OFFLOAD_PEAK_RATIO = 0.5
LOSS_TOLERANCE = 0.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    parser.add_argument("--procs", type=int, default=1, help="processes (GPUs) per run")
    parser.add_argument("--parallelism", choices=("fsdp", "hsdp"), default="fsdp")
    parser.add_argument("--shard-size", type=int, default=None, help="train.shard_size with --parallelism hsdp")
    parser.add_argument("--smoke", action="store_true", help="CPU, a small model, no offload: checks the script")
    parser.add_argument("--json", type=Path, default=None, help="write the figures and checks here")
    return parser.parse_args(argv)


def train_keys(args: argparse.Namespace, offload: bool) -> dict[str, object]:
    keys: dict[str, object] = {
        "parallelism": args.parallelism,
        "cpu_offload": offload,
        "micro_batch_size": 1,
        "grad_accum": 1,
        "optimizer": "adamw",
        "grad_clip": 1.0,
        "lr": 1e-5,
        "max_steps": args.steps,
        "save_every_steps": 0,
        "log_every_steps": 1,
        "compile": False,  # the check is memory, not speed: no compilation in the first steps
        "seed": 1,
    }
    if args.parallelism == "hsdp" and args.shard_size:
        keys["shard_size"] = args.shard_size
    return keys


def planned_peak(spec_file: Path) -> float | None:
    """``jobgen plan``'s predicted peak per GPU (GiB) for the run, or None when it gives none."""
    from jobgen.plan.memory_plan import plan_run
    from jobgen.spec.loader import load_run

    plan = plan_run(load_run(spec_file))
    return plan.peak / GIB if not plan.unavailable else None


def one_run(args: argparse.Namespace, work: Path, model: Path, offload: bool) -> dict[str, object]:
    """Train once; what it did and what it took."""
    from bench_run import prepared_run, train

    from helpers import DATA, losses

    name = f"{args.parallelism}-{'offload' if offload else 'on-gpu'}"
    run, spec_file = prepared_run(
        work,
        name,
        procs=args.procs,
        site="local"
        if args.smoke
        else {"profile": "local", "slurm": {"gpus_per_node": args.procs, "cpus_per_node": 16}},
        model={"path": model, "dtype": "bfloat16", "gradient_checkpointing": True},
        data={"path": DATA, "max_length": 512 if args.smoke else 2048, "packing": True},
        train=train_keys(args, offload),
    )
    plan = planned_peak(spec_file)
    started = time.monotonic()
    # The optimizer steps on the CPU when offloaded: give it the node's cores, not one.
    train(run, args.procs, env={"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.procs))})
    summary = json.loads((run / "metrics.json").read_text())
    peaks = summary["memory_peaks"]
    phases = [v for k, v in peaks.items() if k in ("load", "first_step", "steady") and isinstance(v, dict)]
    return {
        "name": name,
        "steps": summary.get("end_step"),
        "seconds_per_step": summary["step_seconds_total"] / max(1, summary["steps_this_job"]),
        "wall_seconds": time.monotonic() - started,
        "planned_gib": plan,
        "gpu_gib": max((v.get("gpu_max_allocated_mib", 0.0) for v in phases), default=0.0) / 1024,
        "host_gib": max((v.get("host_rss_peak_mib", 0.0) for v in phases), default=0.0) / 1024,
        "losses": losses(run),
    }


def report(result: dict) -> None:
    plan = result["planned_gib"]
    planned = f"{plan:.2f} GiB ({plan / max(result['gpu_gib'], 1e-9):.2f}x measured)" if plan else "no figure"
    print(
        f"{result['name']}: {result['steps']} steps, {result['seconds_per_step']:.2f} s/step; "
        f"GPU max_memory_allocated {result['gpu_gib']:.2f} GiB, jobgen plan {planned}; "
        f"host RSS peak {result['host_gib']:.2f} GiB"
    )
    print("  losses: " + ", ".join(f"{step}: {loss:.4f}" for step, loss in sorted(result["losses"].items())))


def checks(args: argparse.Namespace, plain: dict, offload: dict) -> dict[str, bool]:
    common = sorted(set(plain["losses"]) & set(offload["losses"]))
    agree = bool(common) and all(
        abs(offload["losses"][s] - plain["losses"][s]) <= LOSS_TOLERANCE * abs(plain["losses"][s]) for s in common
    )
    return {
        f"both runs finished {args.steps} steps": plain["steps"] == offload["steps"] == args.steps,
        f"offloaded GPU peak at most {OFFLOAD_PEAK_RATIO:.0%} of the other": 0
        < offload["gpu_gib"]
        <= OFFLOAD_PEAK_RATIO * plain["gpu_gib"],
        f"losses agree within {LOSS_TOLERANCE:.0%}": agree,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if torch.cuda.device_count() < args.procs and not args.smoke:
        print(f"needs {args.procs} GPU(s), this machine has {torch.cuda.device_count()}")
        write_result(args.json, {"error": "no GPU", "checks": {}})
        return 1
    work = args.work or Path(tempfile.mkdtemp(prefix="jobgen-offload-"))
    model = work / ("model-small" if args.smoke else "llama-1b-random")
    random_bf16_model(model, SMALL if args.smoke else LLAMA_1B, max_positions=2048, max_shard_size="1GB")
    plain = one_run(args, work, model, offload=False)
    report(plain)
    if args.smoke:  # the trainer refuses cpu_offload on a CPU: the script ran, nothing is checked
        write_result(args.json, {"figures": figures(plain, None), "checks": {}})
        return 0 if plain["steps"] == args.steps else 1
    offload = one_run(args, work, model, offload=True)
    report(offload)
    results = checks(args, plain, offload)
    for what, ok in results.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    write_result(args.json, {"figures": figures(plain, offload), "checks": results})
    return 0 if all(results.values()) else 1


def figures(plain: dict, offload: dict | None) -> dict[str, float | None]:
    """The table's figures: each run's GPU peak, plan and seconds per step."""
    out: dict[str, float | None] = {}
    for key, result in (("on_gpu", plain), ("offload", offload)):
        if result is not None:
            out[f"{key}_peak_gib"] = round(result["gpu_gib"], 2)
            out[f"{key}_plan_gib"] = round(result["planned_gib"], 2) if result["planned_gib"] else None
            out[f"{key}_s_per_step"] = round(result["seconds_per_step"], 2)
    return out


if __name__ == "__main__":
    sys.exit(main())
