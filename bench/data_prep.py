"""Data preparation: rank 0's tokenization of a large set with every CPU the job has,
against one process, and the cost of reusing the cache.

Generates ``--rows`` alpaca-shaped rows (the generator of bench/throughput_cpu.py: lognormal
lengths with a long tail) as JSONL and the same locally trained tokenizer, then builds the
tokenized cache entry through the trainer's own code path (``trainer.data.cache``: hash
the file, load it, tokenize into a staging directory, save, fsync, rename), into a fresh
cache root each time, with ``data.num_proc`` = 1, then 2, 4, ... up to the CPUs this process
may use. Then the call a requeued job makes against the warm cache: hash, find the entry,
open it.

On the machine that prepares data (about 10 minutes for 1M rows on 2 cores; 3 GB of disk):

    .venv/bin/python bench/data_prep.py --work DIR [--rows 1000000]

Prints a table and writes ``DIR/data_prep.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_cpu import SHAPE, make_data, single_token_words


def build(spec, tokenizer, model: Path, cache_root: Path) -> tuple[float, Path]:
    """Seconds to find-or-build the entry (the rank-0 half of prepare_dataset), and the entry."""
    from trainer.data.cache import _rank0_prepare

    started = time.perf_counter()
    fingerprint = _rank0_prepare(spec, tokenizer, model, cache_root)
    return time.perf_counter() - started, cache_root / fingerprint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from transformers import AutoTokenizer

    from jobgen.base.owned_dir import OwnedDir
    from jobgen.cli.tinymodel import make_tiny_model
    from jobgen.spec.tables.data import DataSpec
    from trainer.data.cache import load_entry

    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, **SHAPE)
    data = args.work / f"alpaca-{args.rows}.jsonl"
    if not data.exists():
        started = time.perf_counter()
        make_data(data, single_token_words(model), args.rows, seed=1)
        size_mb = data.stat().st_size / 1e6
        print(f"generated {args.rows} rows ({size_mb:.0f} MB) in {time.perf_counter() - started:.0f}s")
    cpus = len(os.sched_getaffinity(0))
    counts = sorted({1, cpus, *(2**k for k in range(1, 8) if 2**k < cpus)})

    results: dict = {
        "machine": f"{platform.node()}: {cpus} CPUs, {platform.processor() or platform.machine()}",
        "rows": args.rows,
        "file_mb": round(data.stat().st_size / 1e6),
        "builds": {},
    }
    # "1 core": one process whose fast tokenizer is single-threaded too. One process otherwise
    # runs the Rust tokenizer on every core for each batch, and only its Python part is serial.
    for label, procs in [("1 core", 1)] + [(str(n), n) for n in counts]:
        spec = DataSpec(path=str(data), max_length=args.max_length, num_proc=procs)
        root = args.work / f"cache-{procs}"
        shutil.rmtree(root, ignore_errors=True)
        single = label == "1 core"
        os.environ["TOKENIZERS_PARALLELISM"] = "false" if single else "true"
        tokenizer = AutoTokenizer.from_pretrained(model)
        seconds, entry = build(spec, tokenizer, model, root)
        stats = json.loads((entry / "stats.json").read_text())
        results["builds"][label] = {"processes": procs, "seconds": round(seconds, 1), "tokens": stats["total_tokens"]}
        if procs == counts[-1]:
            # The warm cache, as the next job finds it: the same call, then the dataset opened.
            started = time.perf_counter()
            _, again = build(spec, tokenizer, model, root)
            with OwnedDir.open(again) as entry:  # read as every rank reads it: checked in full
                dataset, _ = load_entry(entry, vocab_size=len(tokenizer))
            rows = len(dataset)
            results["cache_hit_seconds"] = round(time.perf_counter() - started, 2)
            results["kept_rows"] = rows
        shutil.rmtree(root, ignore_errors=True)

    base = results["builds"]["1 core"]["seconds"]
    print(f"{results['machine']}; {args.rows} rows, {results['file_mb']} MB of JSONL")
    print(f"{'processes':>9} {'seconds':>8} {'rows/s':>9} {'tokens/s':>10} {'vs 1 core':>10} {'per core':>9}")
    for label, build_result in results["builds"].items():
        s = build_result["seconds"]
        build_result["speedup"] = round(base / s, 2)
        cores = cpus if label != "1 core" else 1
        print(
            f"{label:>9} {s:8.1f} {args.rows / s:9.0f} {build_result['tokens'] / s:10.0f} "
            f"{base / s:9.2f}x {base / s / cores:8.0%}"
        )
    print(f"warm cache: found and opened in {results['cache_hit_seconds']:.2f}s ({results['kept_rows']} rows)")
    (args.work / "data_prep.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
