"""Trainer throughput on CPU: jobgen's trainer against the Hugging Face ``Trainer`` a user
would write, same model, data, world size, max_length, micro-batch and number of steps, in
one run.

- baseline A: ``Trainer``, every example padded to max_length (``bench/hf_baseline.py``);
- baseline B: ``Trainer``, each batch padded to its longest example;
- jobgen without packing (one example per row, padded to the longest in the batch);
- jobgen with packing (best-fit rows of max_length).

Data: alpaca-shaped rows written here (instruction, half of them with an input, output),
word counts lognormal with a long tail, as real instruction sets are. Model: a random
Llama (hidden 512, 4 layers, intermediate 1376, 8 heads, vocabulary 32000: a small model's
proportions, where the output layer is a large part of the work). Every run uses AdamW, the
same learning rate and seed, and as many threads as the machine has cores; each runs in a
process of its own. Figures are over the steps after ``--warmup``.

    .venv/bin/python bench/throughput_cpu.py [--work DIR] [--steps 30] [--examples 4000]

Prints a table (useful tokens/s are the non-padding ones; ratios against baseline B) and
writes ``DIR/throughput_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_run import prepared_run, train

from helpers import REPO

# jobgen.cli.tinymodel.make_tiny_model's keywords.
SHAPE = {
    "hidden_size": 512,
    "layers": 4,
    "intermediate_size": 1376,
    "heads": 8,
    "kv_heads": 8,
    "model_vocab_size": 32000,
}


def single_token_words(model: Path) -> list[str]:
    """Words the model's tokenizer encodes as one token each: the generated rows then have the
    token lengths their word counts say (the bench's tokenizer is small; real ones are not)."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model).get_vocab()
    return sorted(w[1:] for w in vocab if w.startswith("\u0120") and w[1:].isalpha() and len(w) > 2)


def make_data(path: Path, words_pool: list[str], examples: int, seed: int) -> None:
    """Alpaca rows with lognormal word counts (medians: instruction 8, input 6 in 40% of the
    rows, output 50 with a long tail): with the Alpaca prompt about 40% of the tokens are
    targets, as in alpaca-style sets."""
    rng = random.Random(seed)

    def words(median: float, sigma: float) -> str:
        n = max(1, min(2000, int(rng.lognormvariate(math.log(median), sigma))))
        return " ".join(rng.choice(words_pool) for _ in range(n))

    with path.open("w") as fh:
        for _ in range(examples):
            row = {
                "instruction": words(8, 0.5),
                "input": words(6, 0.8) if rng.random() < 0.4 else "",
                "output": words(50, 0.9),
            }
            fh.write(json.dumps(row) + "\n")


def child_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def hf_run(work: Path, model: Path, data: Path, padding: str, args) -> dict:
    out = work / f"hf-{padding}.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "hf_baseline.py"),
        *("--model", str(model), "--data", str(data), "--padding", padding, "--out", str(out)),
        *("--max-length", str(args.max_length), "--micro-batch", str(args.micro_batch)),
        *("--steps", str(args.steps), "--warmup", str(args.warmup)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(args), check=False)
    if proc.returncode != 0:
        raise SystemExit(f"baseline {padding} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def env(args) -> dict[str, str]:
    threads = str(max(1, (os.cpu_count() or 1) // args.procs))
    return {**os.environ, "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def run_trainer(work: Path, name: str, args, **tables: dict) -> Path:
    """One run of jobgen's trainer under torchrun with ``args.procs`` ranks, from a spec of the
    given tables ([model], [data], [train], [eval]...); returns its run directory."""
    run, _ = prepared_run(work, name, procs=args.procs, **tables)
    train(run, args.procs, env=env(args))
    return run


def ours(work: Path, model: Path, data: Path, packing: bool, args, extra_train: dict | None = None) -> dict:
    name = "jobgen-packed" if packing else "jobgen-unpacked"
    before = child_peak_mib()
    path = run_trainer(
        work,
        name,
        args,
        model={"path": model},
        data={"path": data, "max_length": args.max_length, "packing": packing},
        train={
            "micro_batch_size": args.micro_batch,
            "grad_accum": 1,
            "lr": 1e-4,
            "optimizer": "adamw",
            "max_steps": args.steps + args.warmup,
            "save_every_steps": 0,
            "log_every_steps": 1,
            "seed": 1,
            **(extra_train or {}),
        },
    )
    lines = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in lines if m["step"] > args.warmup]
    assert len(timed) == args.steps, f"{name}: {len(timed)} timed steps in {path}, expected {args.steps}"
    peaks = json.loads((path / "metrics.json").read_text()).get("memory_peaks", {}).get("max_over_ranks", {})
    peak = max((v.get("host_rss_peak_mib", 0.0) for v in peaks.values()), default=max(before, child_peak_mib()))
    return {
        "steps": len(timed),
        "useful_tokens": sum(m["step_tokens"] for m in timed),
        "total_tokens": sum(m.get("step_padded_tokens", m["step_tokens"]) for m in timed),
        "seconds": sum(m["step_seconds"] for m in timed),
        "peak_rss_mib": peak,
    }


def length_distribution(model: Path, data: Path, max_length: int) -> dict:
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO))
    from trainer.data.formats import alpaca_segments

    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = []
    for line in data.read_text().splitlines():
        row = json.loads(line)
        text = "".join(piece for piece, _ in alpaca_segments(row, "row")) + tokenizer.eos_token
        lengths.append(min(max_length, len(tokenizer(text)["input_ids"])))
    lengths.sort()

    def pct(p: float) -> int:
        return lengths[min(len(lengths) - 1, int(p * len(lengths)))]

    return {
        "examples": len(lengths),
        "mean": round(statistics.mean(lengths), 1),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": lengths[-1],
        "truncated_at_max_length": sum(1 for n in lengths if n >= max_length),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing starts")
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--procs", type=int, default=1, help="processes (ranks) for jobgen's runs")
    parser.add_argument("--only", nargs="*", default=None, help="a subset of: hf-max_length hf-longest unpacked packed")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="jobgen-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        from jobgen.cli.tinymodel import make_tiny_model

        make_tiny_model(model, **SHAPE)
    data = work / "alpaca-shaped.jsonl"
    if not data.exists():
        make_data(data, single_token_words(model), args.examples, seed=7)
    lengths = length_distribution(model, data, args.max_length)
    print(f"data: {json.dumps(lengths)}", flush=True)
    runs = {
        "hf-max_length": lambda: hf_run(work, model, data, "max_length", args),
        "hf-longest": lambda: hf_run(work, model, data, "longest", args),
        "unpacked": lambda: ours(work, model, data, False, args),
        "packed": lambda: ours(work, model, data, True, args),
    }
    results = {}
    for name, fn in runs.items():
        if args.only and name not in args.only:
            continue
        results[name] = fn()
        r = results[name]
        print(
            f"{name:<14} useful {r['useful_tokens'] / r['seconds']:8.0f} tok/s   total "
            f"{r['total_tokens'] / r['seconds']:8.0f} tok/s   peak RSS {r['peak_rss_mib']:6.0f} MiB",
            flush=True,
        )
    base = results.get("hf-longest")
    if base:
        base_rate = base["useful_tokens"] / base["seconds"]
        for name, r in results.items():
            r["useful_ratio_vs_hf_longest"] = round(r["useful_tokens"] / r["seconds"] / base_rate, 2)
            print(f"{name:<14} {r['useful_ratio_vs_hf_longest']:.2f}x baseline B (useful tokens/s)")
    report = {
        "machine": {"cpus": os.cpu_count(), "threads_per_process": env(args)["OMP_NUM_THREADS"]},
        "shape": SHAPE,
        "settings": {k: v for k, v in vars(args).items() if k not in ("work", "only")},
        "lengths": lengths,
        "results": results,
    }
    (work / "throughput_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {work / 'throughput_cpu.json'}")


if __name__ == "__main__":
    main()
