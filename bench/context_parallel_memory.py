"""Peak memory per rank of one forward and backward of a long packed row: context parallelism
(trainer/parallel/context_parallel.py) on N = 2 and 4 ranks against N = 1, the model's own attention
(what the trainer runs without ``train.context_parallel``). ``--attention`` picks the kernel of
both sides: ``sdpa`` (the module's SDPA path, a dense (L/N) x L mask) or ``flex_attention`` (the
model's flex at N = 1, the module's flex path with its block mask at N > 1; the trainer's GPU
default for packed rows). ``1m`` is N = 1 through the module (one process, nothing gathered): it
separates the module's own cost or saving from the split of the row (with sdpa: one additive
mask shared by every layer, where transformers' boolean mask makes SDPA save a converted copy
per layer).

A random tiny-but-long Llama (hidden 256, 4 layers, 4 query and 2 key/value heads, vocabulary
2048, untied: 3.95M parameters) gets one row of ``--max-length`` tokens packed with four documents
(the last one shorter, so the row is not a multiple of 2N and the padding path runs). With N ranks
each rank holds L/N of the row's tokens, and attention runs its L/N queries against the
all-gathered keys under the document-causal mask. Each N is its own ``torchrun`` (gloo),
launched by this script, in a fresh process per rank; no FSDP (the weights are a few MiB).

Figures per rank (the largest over the N ranks):

- ``--device cpu``: the first step's peak resident set above the resident set just before it
  (``ru_maxrss``; a fresh process, so the step is the process's peak), and a second step's peak
  of live tensor bytes, weights and gradients included, from torch's ``MemTracker``
  (a dispatch mode: slow, exact for tensors, blind to allocator slack). sdpa only: torch 2.13's
  flex_attention has no backward on CPU (the script says so before it starts).
- ``--device cuda``: after a warm-up step (which also compiles flex), ``torch.cuda.max_memory_allocated``
  of one step, and the same above what was allocated before it (the step's own peak). Ranks share
  the GPUs round-robin: several ranks on one GPU is fine, since the backend stays gloo (NCCL
  refuses two ranks on one device); K/V travel through host memory then (``_HostGather``), which
  costs time, not device memory. bf16 autocast as the trainer uses on CUDA.

The ratio is peak(N) / peak(1), measured in the same invocation. On this machine (2 cores,
about 4 minutes):

    .venv/bin/python bench/context_parallel_memory.py --device cpu --max-length 8192 --cp 1,1m,2,4

on a GPU machine (one GPU is enough), once with each kernel. Measured on an H100 at 32768 with
sdpa (allocated peak): N = 1 11208 MiB, 1m 15032, N = 2 7631, N = 4 3930; N = 1 with flex 2681.

    python3 bench/context_parallel_memory.py --device cuda --max-length 32768 --cp 1,1m,2,4
    python3 bench/context_parallel_memory.py --device cuda --max-length 32768 --cp 1,1m,2,4 --attention flex_attention

Prints one line per N and writes them to ``--out`` (default: ``WORK/context_parallel_memory.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
SHAPE = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "use_cache": False,
}


def save_model(directory: Path, max_length: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, max_position_embeddings=max_length))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def long_row(max_length: int):
    """One packed row: documents of 1/2, 1/4, 1/8 of the row and a last one 5 tokens short of
    filling it; the first third of each document is prompt (no targets)."""
    import torch

    from trainer.data.packing import collate

    g = torch.Generator().manual_seed(1)
    sizes = [max_length // 2, max_length // 4, max_length // 8]
    sizes.append(max_length - sum(sizes) - 5)
    docs = []
    for n in sizes:
        ids = torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist()
        docs.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})
    return collate([docs], pad_token_id=0, packing=True)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> None:
    """One rank: load, shard, measure; writes its figures to ``OUT.RANK``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from trainer.data.packing import model_inputs, token_loss_sum
    from trainer.parallel.context_parallel import ContextParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    attention = {"attn_implementation": args.attention}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **attention).to(device)
    batch = long_row(args.max_length)
    cp = ContextParallel(dist.group.WORLD if world > 1 else None, args.attention) if args.module else None
    if cp is not None:
        cp.install(model)  # the SDPA or the flex path, as args.attention says
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> float:
        started = time.monotonic()
        with autocast:
            if cp is None:
                summed, _ = token_loss_sum(model(**model_inputs(batch_on(batch, device))).logits, batch["labels"])
                summed.backward()
            else:
                local = cp.shard(batch)
                with cp.active(local):
                    summed, _ = cp.loss_sum(model(**local.model_inputs(device)).logits, local.labels)
                    summed.backward()
        model.zero_grad(set_to_none=False)  # gradients stay allocated: steady state
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic() - started

    figures = measure_cuda(step) if device.type == "cuda" else measure_cpu(step, model)
    Path(f"{args.out}.{rank}").write_text(json.dumps(figures))
    dist.destroy_process_group()


def batch_on(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def measure_cpu(step, model) -> dict[str, float]:
    """The first step's peak RSS above the RSS before it, then a second step's tensor peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    before = rss_bytes()
    seconds = step()
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    tensors = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return {"rss_step_mib": rss_peak / MIB, "tensor_peak_mib": tensors / MIB, "seconds": seconds}


def measure_cuda(step) -> dict[str, float]:
    """After a warm-up step: the allocator's peak of one step, total and above its start."""
    import torch

    step()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    seconds = step()
    peak = torch.cuda.max_memory_allocated()
    return {"allocated_peak_mib": peak / MIB, "step_peak_mib": (peak - before) / MIB, "seconds": seconds}


def launch(args: argparse.Namespace, model: Path, work: Path, size: str) -> dict[str, float]:
    """This script's worker on ``size`` processes ("1m": the module on one); the largest figure over ranks."""
    ranks = int(size.rstrip("m"))
    out = work / f"cp{size}"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", __file__]
    cmd += ["--worker", "--model", str(model), "--out", str(out), "--device", args.device]
    cmd += ["--max-length", str(args.max_length), "--attention", args.attention]
    cmd += ["--module"] if size != "1" else []
    threads = str(max(1, (os.cpu_count() or 1) // ranks)) if args.device == "cpu" else "4"
    env = {**os.environ, "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"CP={ranks} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(ranks)]
    return {key: max(r[key] for r in reports) for key in reports[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument(
        "--cp",
        default="1,1m,2,4",
        help="context-parallel sizes, comma-separated, the baseline first; 1m: N=1 through the module",
    )
    parser.add_argument(
        "--attention",
        choices=["sdpa", "flex_attention"],
        default="sdpa",
        help="the kernel of the N=1 baseline and of the module (flex_attention: the trainer's GPU default)",
    )
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--module", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sizes = args.cp.split(",")
    if args.attention == "flex_attention" and args.device == "cpu":  # torch 2.13: no backward
        sys.path.insert(0, str(REPO))
        from trainer.parallel.context_parallel import flex_backward_error

        error = flex_backward_error(args.device)
        if error:
            raise SystemExit(f"cannot measure flex_attention's forward and backward here: {error}")
    work = args.work or Path(tempfile.mkdtemp(prefix="cp-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    model = save_model(work / "model", args.max_length)
    results = {n: launch(args, model, work, n) for n in sizes}
    key = "tensor_peak_mib" if args.device == "cpu" else "allocated_peak_mib"
    base = results[sizes[0]][key]
    for n, figures in results.items():
        figures["ratio"] = figures[key] / base
        shown = "  ".join(f"{k} {v:.2f}" if k in ("seconds", "ratio") else f"{k} {v:.0f}" for k, v in figures.items())
        print(f"CP={n} max_length={args.max_length} {args.device} {args.attention}: {shown}")
    out = args.out or work / "context_parallel_memory.json"
    head = {"device": args.device, "max_length": args.max_length, "attention": args.attention, "ratio_of": key}
    out.write_text(json.dumps({**head, **results}))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
