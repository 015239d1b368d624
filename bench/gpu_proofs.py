"""The GPU proofs in one run and one table (issue 34): what jobgen claims for a GPU, checked
in the order that matters if time runs out.

1. **7B memory-lean** (bench/gpu_7b.py): a Llama-2-7B shape fully fine-tuned on one GPU within
   24 GiB (peak ``max_memory_allocated`` at most 22 GiB, ``jobgen plan`` within 15 %).
2. **MFU against the HF Trainer** (bench/throughput_gpu.py ``--only jobgen hf-longest``): a
   ~1.5B Llama (Llama-3.2-1B's shape, untied) in bf16, jobgen's trainer against a Hugging Face
   ``Trainer`` script padding to the longest example, same data; MFU and the ratio.
3. **CPU offload** (bench/gpu_offload_check.py): a 1.1B Llama with and without
   ``train.cpu_offload``: the GPU peak at most halved, losses within 2 %.
4. **Greedy samples through flex attention with compiled blocks** (bench/gpu_samples_check.py).

Each part is its own process with a time cap (the caps add up to ``--budget``, 8 minutes by
default), so a part that fails or runs out of time is a row of the table, not the end of the
run. Run by bench/gpu_proofs.sh, which first makes the environment on a bare GPU machine:

    bash bench/gpu_proofs.sh [--work DIR] [--out DIR] [--only 7b mfu ...]
    bash bench/gpu_proofs.sh --smoke          # CPU, tiny shapes: every script end to end (CI)

Prints the table (markdown, for BENCHMARKS.md) and writes ``gpu_proofs.json`` and each part's
log to ``--out`` (default: the working directory). Exit status 0 when every part ran and every
check held (with ``--smoke``: when every part ran).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SMOKE_CAP_SECONDS = 900.0


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    script: str
    gpu_args: tuple[str, ...]
    smoke_args: tuple[str, ...]
    cap_share: float  # of --budget

    def argv(self, smoke: bool, work: Path, result: Path) -> list[str]:
        args = self.smoke_args if smoke else self.gpu_args
        return [sys.executable, str(BENCH / self.script), *args, "--work", str(work / self.key), "--json", str(result)]


PARTS = (
    Part("7b", "7B memory-lean, 24 GiB", "gpu_7b.py", ("--steps", "10"), ("--small", "--steps", "2"), 0.38),
    Part(
        "mfu",
        "MFU vs HF Trainer, 1.5B",
        "throughput_gpu.py",
        ("--only", "jobgen", "hf-longest", "--steps", "15", "--warmup", "5", "--examples", "20000"),
        ("--smoke", "--only", "jobgen", "hf-longest"),
        0.31,
    ),
    Part("offload", "CPU offload, 1.1B", "gpu_offload_check.py", ("--steps", "4"), ("--smoke", "--steps", "2"), 0.19),
    Part("samples", "flex + compiled samples", "gpu_samples_check.py", (), ("--smoke", "--new-tokens", "8"), 0.12),
)


def run_part(part: Part, args: argparse.Namespace, work: Path, out: Path) -> dict:
    """One part under its time cap; its result file's figures and checks, or why there are none."""
    result, log = out / f"{part.key}.json", out / f"{part.key}.log"
    result.unlink(missing_ok=True)
    # On a GPU the caps share the lease's minutes; the smoke run (CI, a loaded CPU) is only
    # kept from hanging.
    cap = SMOKE_CAP_SECONDS if args.smoke else max(30.0, part.cap_share * args.budget)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(part.argv(args.smoke, work, result), stdout=fh, stderr=subprocess.STDOUT,
                                  env=env, timeout=cap, check=False)  # fmt: skip
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = round(time.monotonic() - started, 1)
    found = json.loads(result.read_text()) if result.exists() else {}
    if code is None:
        status = f"timed out after {cap:.0f} s"
    elif "error" in found or not found:
        status = found.get("error") or f"exited {code} without figures ({log.name})"
    else:
        failed = [what for what, held in found.get("checks", {}).items() if not held]
        status = "ok" if code == 0 and not failed else ("FAIL: " + "; ".join(failed) if failed else f"exited {code}")
    return {"part": part.key, "title": part.title, "status": status, "seconds": seconds,
            "figures": found.get("figures", {}), "checks": found.get("checks", {})}  # fmt: skip


def describe() -> dict[str, str]:
    """The machine and versions the figures belong to."""
    import torch
    import transformers

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def table(rows: list[dict], about: dict[str, str]) -> str:
    lines = [
        f"{about['device']}, torch {about['torch']}, transformers {about['transformers']}, {about['date']}",
        "",
        "| part | result | figures | seconds |",
        "|---|---|---|---:|",
    ]
    for row in rows:
        figures = ", ".join(f"{k} {v}" for k, v in row["figures"].items() if v is not None) or "-"
        lines.append(f"| {row['title']} | {row['status']} | {figures} | {row['seconds']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="working directory (models, runs; ~20 GB on a GPU)")
    parser.add_argument("--out", type=Path, default=None, help="where the table's JSON and the logs go")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all parts together")
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of: {' '.join(p.key for p in PARTS)}")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: every script end to end")
    args = parser.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="jobgen-gpu-proofs-"))).absolute()
    out = (args.out or work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    about = describe()
    if not args.smoke and "cpu" in about["device"]:
        print("no GPU here: bash bench/gpu_proofs.sh --smoke checks the scripts on a CPU")
        return 1
    rows = []
    for part in PARTS:
        if args.only and part.key not in args.only:
            continue
        rows.append(run_part(part, args, work, out))
        print(f"{part.key}: {rows[-1]['status']} ({rows[-1]['seconds']} s)", flush=True)
    print(table(rows, about))
    (out / "gpu_proofs.json").write_text(json.dumps({"about": about, "parts": rows}, indent=2) + "\n")
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
