"""GPU proof of the memory-lean recipe: a 7B full fine-tune inside 24 GiB of one GPU.

A randomly initialised Llama-2-7B shape (hidden 4096, 32 layers, intermediate 11008,
32 heads, vocabulary 32000; built from a config, nothing downloaded) in bf16 is trained
by the real trainer for 20 optimizer steps on packed 4096-token rows, micro-batch 1,
with the recipe of Forgather's Samantha tutorial:

    [model] dtype = "bfloat16", gradient_checkpointing = true, activation_offloading = true
    [train] optimizer = "adafactor", optimizer_in_backward = true, grad_clip = 0,
            loss_chunk_tokens = 1024
    site slurm.device_memory = "24GiB"   (the trainer caps its CUDA allocations to it)

Checks: every step finished; the peak of ``torch.cuda.max_memory_allocated`` (the
trainer's ``metrics.json`` ``memory_peaks``) is at most 22 GiB; ``jobgen plan``'s
prediction for the same run is within 15 % of it. On a machine with one GPU (an H100
or any card with more than 24 GiB; about 14 GiB of disk for the model), one command:

    .venv/bin/python bench/gpu_7b.py [--work DIR] [--steps 20]

``--small`` runs the same pipeline on a 4-layer model of hidden 256 and 512-token rows (CPU or
GPU, seconds), to check the script itself; its figures are printed, not checked. ``--json FILE``
writes the figures and checks (bench/gpu_proofs.py reads them). Exit status 0 when every check
holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_run import prepared_run, random_bf16_model, write_result

from helpers import DATA, VENV_BIN, torchrun

GIB = 2**30
# jobgen.cli.tinymodel.make_tiny_model's keywords.
LLAMA2_7B = {"hidden_size": 4096, "layers": 32, "intermediate_size": 11008, "heads": 32, "kv_heads": 32}
SMALL = {"hidden_size": 256, "layers": 4, "intermediate_size": 704, "heads": 4, "kv_heads": 4}
PEAK_LIMIT_GIB = 22.0
PLAN_TOLERANCE = 0.15


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--small", action="store_true", help="a small model: checks the script only")
    parser.add_argument("--json", type=Path, default=None, help="write the figures and checks here")
    args = parser.parse_args()
    max_length = 512 if args.small else 4096
    work = args.work or Path(tempfile.mkdtemp(prefix="jobgen-gpu7b-"))
    model = work / ("model-small" if args.small else "llama2-7b-random")
    random_bf16_model(model, SMALL if args.small else LLAMA2_7B, max_positions=max_length)
    run, spec_file = prepared_run(
        work,
        "lean7b",
        site={"profile": "local", "slurm": {"gpus_per_node": 1, "device_memory": "24GiB"}},
        model={
            "path": model,
            "dtype": "bfloat16",
            "gradient_checkpointing": True,
            "activation_offloading": True,
        },
        data={"path": DATA, "max_length": max_length, "packing": True},
        train={
            "parallelism": "ddp",
            "micro_batch_size": 1,
            "grad_accum": 1,
            "optimizer": "adafactor",
            "optimizer_in_backward": True,
            "grad_clip": 0.0,
            "loss_chunk_tokens": min(1024, max_length),
            "lr": 1e-5,
            "max_steps": args.steps,
            "save_every_steps": 0,
            "log_every_steps": 1,
            "seed": 1,
        },
    )
    planned = subprocess.run(
        [str(VENV_BIN / "jobgen"), "plan", str(spec_file), "--json"], capture_output=True, text=True, check=False
    )
    prediction = json.loads(planned.stdout) if planned.stdout.strip().startswith("{") else {}
    proc = torchrun(run, nproc=1, timeout=7200)
    print(proc.stdout[-4000:])
    if proc.returncode != 0:
        print(proc.stderr[-6000:], file=sys.stderr)
        print(f"FAILED: the trainer exited {proc.returncode}")
        write_result(args.json, {"error": f"the trainer exited {proc.returncode}", "checks": {}})
        return 1
    summary = json.loads((run / "metrics.json").read_text())
    peaks = summary["memory_peaks"]
    phases = {k: v for k, v in peaks.items() if isinstance(v, dict) and k in ("load", "first_step", "steady")}
    gpu = max((v.get("gpu_max_allocated_mib", 0.0) for v in phases.values()), default=0.0) / 1024
    host = max(v.get("host_rss_peak_mib", 0.0) for v in phases.values()) / 1024
    steps = summary.get("end_step")
    planned_gib = prediction.get("peak_bytes", 0) / GIB if prediction else None
    print(f"steps {steps} of {args.steps}; peak max_memory_allocated {gpu:.2f} GiB; host RSS peak {host:.2f} GiB")
    print(f"jobgen plan predicts {planned_gib:.2f} GiB" if planned_gib else f"jobgen plan gave no figure: {planned}")
    figures = {"steps": steps, "peak_gpu_gib": round(gpu, 2), "host_rss_gib": round(host, 2),
               "plan_gib": round(planned_gib, 2) if planned_gib else None}  # fmt: skip
    # The small model checks the script only: its figures say nothing about the recipe's claim.
    checks = {} if args.small else {
        f"{args.steps} steps": steps == args.steps,
        f"peak at most {PEAK_LIMIT_GIB} GiB": 0 < gpu <= PEAK_LIMIT_GIB,
        f"plan within {PLAN_TOLERANCE:.0%}": bool(planned_gib) and abs(planned_gib - gpu) <= PLAN_TOLERANCE * gpu,
    }  # fmt: skip
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    write_result(args.json, {"figures": figures, "checks": checks})
    return 0 if all(checks.values()) and steps == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
