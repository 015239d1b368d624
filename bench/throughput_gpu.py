"""Trainer throughput and MFU on one GPU: jobgen's trainer against the Hugging Face ``Trainer``
script padding to the longest example (baseline B), same model, data and GPU, in one run.

The model is a randomly initialised Llama of about 1.5B parameters (the Llama-3.2-1B shape,
untied: hidden 2048, 16 layers, intermediate 8192, 32 heads, 8 KV heads, vocabulary 128256),
trained in bf16 on alpaca-shaped data (the generator of bench/throughput_cpu.py). Runs:

- ``hf-longest``: bench/hf_baseline.py ``--cuda``: weights in bf16, ``bf16=True``, sdpa with the
  padding mask, every position's logits;
- ``jobgen``: the trainer under torchrun, FSDP2 on one process, packed 4096-token rows, with
  the defaults of a GPU site: flex attention with a per-document block mask, compiled decoder
  blocks, fused AdamW, the output layer at target positions only, pinned non-blocking copies;
- ablations, each the ``jobgen`` run with one piece off: ``jobgen-sdpa`` (model.attention =
  "sdpa": the dense block-diagonal mask), ``jobgen-eager`` (train.compile = false),
  ``jobgen-all-logits`` (train.target_logits_only = false).

Figures: useful (non-padding) and all tokens/s, peak GPU memory, the ratio to B, and MFU:
(6 x N x useful tokens + attention FLOPs) / (seconds x the GPU's dense bf16 peak). N counts
every parameter but the input embedding; attention FLOPs are 6 x layers x hidden x the sum
over examples of length squared (causal, forward and backward, within each example: what a
document mask computes). The peak comes from the device name (H100/H200 SXM 989 TFLOP/s,
H100 PCIe 756, A100 312, L40S 362) or ``--peak-tflops``.

On a machine with one GPU and the [train] extra (about 15 minutes; targets: MFU >= 45 %,
jobgen >= 1.5x B in useful tokens/s):

    .venv/bin/python bench/throughput_gpu.py --work DIR [--only jobgen hf-longest]

``--smoke`` runs the whole script on CPU with a small model and a few steps (no MFU), to
check it where there is no GPU. Writes ``DIR/throughput_gpu.json``; ``--json FILE`` also writes
the headline figures and the targets as checks (bench/gpu_proofs.py reads them).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_run import prepared_run, train, write_result
from throughput_cpu import make_data, single_token_words

from helpers import REPO

# jobgen.cli.tinymodel.make_tiny_model's keywords: Llama-3.2-1B's shape, untied.
SHAPE = {
    "hidden_size": 2048,
    "layers": 16,
    "intermediate_size": 8192,
    "heads": 32,
    "kv_heads": 8,
    "model_vocab_size": 128256,
    "max_position_embeddings": 8192,
}
# --smoke: the tests' tiny model (jobgen.cli.tinymodel's defaults): the script, not a figure.
SMOKE_SHAPE: dict[str, int] = {}
MFU_TARGET, RATIO_TARGET = 0.45, 1.5
PEAK_TFLOPS = {"H200": 989, "H100 PCIe": 756, "H100": 989, "A100": 312, "L40S": 362}
RUNS = {
    "jobgen": {},
    "jobgen-sdpa": {"model": {"attention": "sdpa"}},
    "jobgen-eager": {"train": {"compile": False}},
    "jobgen-all-logits": {"train": {"target_logits_only": False}},
}


def peak_flops(override: float | None) -> float | None:
    if override:
        return override * 1e12
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_TFLOPS.items():  # "H100 PCIe" before "H100"
        if key in name:
            return tflops * 1e12
    raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops (dense bf16)")


def model_flops(model: Path, useful_tokens: int, doc_lengths_sq: int) -> float:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    h, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o, k, v projections and the gated MLP
    n = layers * per_layer + h * vocab  # the output layer; the input embedding is a lookup
    return 6 * n * useful_tokens + 6 * layers * h * doc_lengths_sq


def ours(work: Path, model: Path, data: Path, name: str, args, smoke: bool) -> dict:
    extra = RUNS[name]
    run, _ = prepared_run(
        work,
        name,
        site="local" if smoke else {"profile": "local", "slurm": {"gpus_per_node": 1}},
        model={"path": model, "dtype": "bfloat16", **extra.get("model", {})},
        data={"path": data, "max_length": args.max_length, "packing": True},
        train={
            "parallelism": "fsdp",
            "micro_batch_size": args.micro_batch,
            "lr": 1e-4,
            "max_steps": args.steps + args.warmup,
            "save_every_steps": 0,
            "log_every_steps": 1,
            "seed": 1,
            **extra.get("train", {}),
        },
    )
    # One rank: torch's own thread count, not the OMP_NUM_THREADS=1 of several ranks per node.
    train(run, 1, env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)})
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in lines if m["step"] > args.warmup]
    peaks = json.loads((run / "metrics.json").read_text()).get("memory_peaks", {}).get("max_over_ranks", {})
    return {
        "steps": len(timed),
        "useful_tokens": sum(m["step_tokens"] for m in timed),
        "total_tokens": sum(m.get("step_padded_tokens", m["step_tokens"]) for m in timed),
        "seconds": sum(m["step_seconds"] for m in timed),
        "peak_gpu_mib": max((v.get("gpu_max_allocated_mib", 0.0) for v in peaks.values()), default=None),
    }


def hf(work: Path, model: Path, data: Path, args, smoke: bool) -> dict:
    out = work / "hf-longest.json"
    cmd = [sys.executable, str(REPO / "bench" / "hf_baseline.py"), "--model", str(model), "--data", str(data)]
    cmd += ["--padding", "longest", "--out", str(out), "--max-length", str(args.max_length)]
    cmd += ["--micro-batch", str(args.hf_micro_batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd + ([] if smoke else ["--cuda"]), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"baseline failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def mean_square_length(model: Path, data: Path, max_length: int) -> float:
    """Mean over examples of length squared (tokens, capped at max_length): the attention FLOPs'
    factor per useful token is this over the mean length."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from trainer.data.formats import alpaca_segments

    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = []
    for line in data.read_text().splitlines()[:2000]:
        text = "".join(piece for piece, _ in alpaca_segments(json.loads(line), "row")) + tokenizer.eos_token
        lengths.append(min(max_length, len(tokenizer(text)["input_ids"])))
    return sum(n * n for n in lengths) / sum(lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (compilation happens here)")
    parser.add_argument("--examples", type=int, default=40000)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4, help="packed rows per step (jobgen)")
    parser.add_argument("--hf-micro-batch", type=int, default=16, help="examples per step (baseline B)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of: hf-longest {' '.join(RUNS)}")
    parser.add_argument("--smoke", action="store_true", help="CPU, a small model, 3 steps: checks the script")
    parser.add_argument("--json", type=Path, default=None, help="write the headline figures and checks here")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.examples, args.max_length = 3, 1, 200, 512
        args.micro_batch, args.hf_micro_batch = 2, 4
    work = args.work or Path(tempfile.mkdtemp(prefix="jobgen-throughput-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        from jobgen.cli.tinymodel import make_tiny_model

        make_tiny_model(model, **(SMOKE_SHAPE if args.smoke else SHAPE))
    data = work / "alpaca-shaped.jsonl"
    if not data.exists():
        make_data(data, single_token_words(model), args.examples, seed=7)
    square = mean_square_length(model, data, args.max_length)
    peak = None if args.smoke else peak_flops(args.peak_tflops)

    results = {}
    for name in ["hf-longest", *RUNS]:
        if args.only and name not in args.only:
            continue
        r = (
            hf(work, model, data, args, args.smoke)
            if name == "hf-longest"
            else ours(work, model, data, name, args, args.smoke)
        )
        r["useful_tokens_per_s"] = round(r["useful_tokens"] / r["seconds"])
        r["mfu"] = (
            round(model_flops(model, r["useful_tokens"], round(square * r["useful_tokens"])) / r["seconds"] / peak, 3)
            if peak
            else None
        )
        results[name] = r
        print(
            f"{name:<18} useful {r['useful_tokens_per_s']:9d} tok/s   all {r['total_tokens'] / r['seconds']:9.0f} tok/s"
            f"   peak GPU {r.get('peak_gpu_mib') or 0:7.0f} MiB   MFU {r['mfu'] if r['mfu'] is not None else '-'}",
            flush=True,
        )
    base = results.get("hf-longest")
    if base:
        for name, r in results.items():
            r["vs_hf_longest"] = round(r["useful_tokens_per_s"] / base["useful_tokens_per_s"], 2)
            print(f"{name:<18} {r['vs_hf_longest']:.2f}x baseline B (useful tokens/s)")
    import torch

    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
        "peak_tflops": peak / 1e12 if peak else None,
        "shape": SMOKE_SHAPE if args.smoke else SHAPE,
        "settings": {k: v for k, v in vars(args).items() if k not in ("work", "only", "json")},
        "mean_square_length_per_token": round(square, 1),
        "results": results,
    }
    (work / "throughput_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {work / 'throughput_gpu.json'}")
    write_result(args.json, headline(results, args.smoke))


def headline(results: dict[str, dict], smoke: bool) -> dict:
    """jobgen against baseline B: the figures and, on a GPU, the targets as checks."""
    ours, base = results.get("jobgen"), results.get("hf-longest")
    figures = {
        "jobgen_useful_tok_s": ours and ours["useful_tokens_per_s"],
        "hf_useful_tok_s": base and base["useful_tokens_per_s"],
        "ratio": ours and ours.get("vs_hf_longest"),
        "jobgen_mfu": ours and ours["mfu"],
        "hf_mfu": base and base["mfu"],
        "jobgen_peak_gpu_mib": ours and ours.get("peak_gpu_mib"),
    }
    checks = {} if smoke or not (ours and base) else {
        f"MFU at least {MFU_TARGET:.0%}": (ours["mfu"] or 0) >= MFU_TARGET,
        f"at least {RATIO_TARGET}x baseline B": ours["vs_hf_longest"] >= RATIO_TARGET,
    }  # fmt: skip
    return {"figures": figures, "checks": checks}


if __name__ == "__main__":
    main()
