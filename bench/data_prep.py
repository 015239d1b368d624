"""Data preparation against rows: jobgen's streaming, sharded tokenization beside the Hugging
Face script a user would write, in the same run, on the same data, with the same processes.

For each ``--rows`` count: alpaca-shaped rows (the generator of bench/throughput_cpu.py:
lognormal lengths with a long tail) as JSONL, and the same locally trained tokenizer. Then,
each in a fresh process and from a cold cache:

- **jobgen**: the trainer's own path (``trainer.data.cache``: hash the file, index its rows,
  tokenize shard by shard with ``--procs`` processes into the shard directory, publish the
  entry) and then the entry opened as every rank opens it (checked in full);
- **HF datasets**: ``datasets.load_dataset("json")`` + ``map(batched=True, num_proc=--procs)``
  of the same formatting and tokenizer (the trainer's ``Encoder``), written to datasets' cache
  on disk as a user's script does.

Times are the preparation's own (imports excluded). The peak memory of each is the most
memory its whole process tree held at once
(the proportional set size, sampled every 100 ms from /proc through psutil: workers
included, a page shared by forked workers counted once). Also the tokenizer alone,
single-threaded, on the formatted texts of the first 20,000 rows: tokens/s per core, the
ceiling of any preparation.

    .venv/bin/python bench/data_prep.py --work DIR [--rows 10000 50000 200000 1000000] [--procs 2]

Prints a table and writes ``DIR/data_prep.json``. About 25 minutes on 2 cores for the default
rows (1M rows is 0.5 GB of JSONL); DIR needs ~5 GB.

A source bigger than the memory the preparation may use (as root, cgroup v1's memory
controller, no swap on the machine: going over the limit is an out-of-memory kill):

    .venv/bin/python bench/data_prep.py --work DIR --rows 3000000 --memory-limit-mib 1024

runs jobgen's preparation alone, its whole process tree in a memory cgroup of that limit (page
cache included), and records the cgroup's own peak (``memory.max_usage_in_bytes``) and
failures (``memory.failcnt``: allocations the limit made the kernel reclaim for).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_cpu import SHAPE, make_data, single_token_words

# One preparation, run by this file in a child process: argv = which, model, data, out dir, procs.
CHILD = r"""
import json, os, sys, time
from pathlib import Path
which, model, data, out, procs = sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5])
from transformers import AutoTokenizer
from jobgen.spec.tables.data import DataSpec
tokenizer = AutoTokenizer.from_pretrained(model)
spec = DataSpec(path=data, max_length=512, num_proc=procs)
started = time.perf_counter()
if which == "jobgen":
    from jobgen.base.owned_dir import OwnedDir
    from trainer.data.cache import load_entry
    from trainer.data.collective import _rank0_prepare
    fingerprint = _rank0_prepare(spec, tokenizer, model, out)
    with OwnedDir.open(out / fingerprint) as entry:
        examples, stats = load_entry(entry, vocab_size=len(tokenizer))
    rows, tokens = len(examples), stats.total_tokens
else:
    import datasets
    from trainer.data.encoder import Encoder
    datasets.disable_progress_bars()
    raw = datasets.load_dataset("json", data_files=data, split="train", cache_dir=str(out / "hf"))
    encoded = raw.map(Encoder(spec, tokenizer, data), batched=True, batch_size=1000, with_indices=True,
                      remove_columns=raw.column_names, num_proc=procs if procs > 1 else None)
    import pyarrow.compute as pc
    kept = encoded.filter(lambda t: [x > 0 for x in t], input_columns=["targets"], batched=True)
    has_target = pc.greater(encoded.data.column("targets"), 0)
    rows, tokens = len(kept), pc.sum(encoded.data.column("length").filter(has_target)).as_py()
print(json.dumps({"seconds": time.perf_counter() - started, "rows": rows, "tokens": tokens}))
"""

TOKENIZER_ALONE = r"""
import json, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from trainer.data.formats import alpaca_segments
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
rows = [json.loads(line) for _, line in zip(range(20000), open(sys.argv[2]))]
texts = [text for row in rows for text, _ in alpaca_segments(row, "bench")]
started = time.perf_counter()
tokens = sum(len(ids) for k in range(0, len(texts), 3000) for ids in tokenizer(texts[k:k + 3000])["input_ids"])
print(json.dumps({"tokens_per_s": tokens / (time.perf_counter() - started)}))
"""


def tree_memory(process: psutil.Process) -> int:
    """The proportional set size of ``process`` and its descendants: pages a forked worker
    shares with its parent count once, as they occupy memory once."""
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_full_info().pss
        except psutil.Error:
            pass  # ended between the listing and the read
    return total


def run_measured(code: str, args: list[str], env: dict[str, str], prefix: list[str] | None = None) -> dict:
    """Run ``code`` in a child (after ``prefix``, a command that execs it); its JSON answer, its
    wall time and its tree's peak PSS (MiB)."""
    child = subprocess.Popen(
        [*(prefix or []), sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    peak, process = 0, psutil.Process(child.pid)

    def sample() -> None:
        nonlocal peak
        while child.poll() is None:
            try:
                peak = max(peak, tree_memory(process))
            except psutil.Error:
                return
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    started = time.perf_counter()
    sampler.start()
    out, err = child.communicate()
    wall = time.perf_counter() - started
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{err.decode()[-4000:]}")
    return {**json.loads(out.decode().strip().splitlines()[-1]), "wall_s": round(wall, 1), "peak_mib": peak >> 20}


CGROUP = Path("/sys/fs/cgroup/memory/jobgen-data-prep")


def limited(limit_mib: int) -> list[str]:
    """A command prefix that runs its command in a fresh memory cgroup of ``limit_mib`` MiB (swap
    included: the limit is the memory, not memory plus swap)."""
    if CGROUP.exists():
        CGROUP.rmdir()
    CGROUP.mkdir()
    (CGROUP / "memory.limit_in_bytes").write_text(str(limit_mib << 20))
    memsw = CGROUP / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        memsw.write_text(str(limit_mib << 20))
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh"]


def bigger_than_memory(args: argparse.Namespace, model: Path, pool: list[str], env: dict[str, str]) -> None:
    """jobgen alone, on a source bigger than the memory its cgroup allows."""
    rows = args.rows[-1]
    data = args.work / f"alpaca-{rows}.jsonl"
    if not data.exists():
        make_data(data, pool, rows, seed=1)
    out = args.work / f"out-jobgen-{rows}"
    shutil.rmtree(out, ignore_errors=True)
    prefix = limited(args.memory_limit_mib)
    try:
        run = run_measured(CHILD, ["jobgen", str(model), str(data), str(out), str(args.procs)], env, prefix)
        peak = int((CGROUP / "memory.max_usage_in_bytes").read_text()) >> 20
        failcnt = int((CGROUP / "memory.failcnt").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
        CGROUP.rmdir()
    result = {
        "rows": rows,
        "file_mib": data.stat().st_size >> 20,
        "limit_mib": args.memory_limit_mib,
        "cgroup_peak_mib": peak,
        "limit_reclaims": failcnt,
        "jobgen": run,
    }
    print(json.dumps(result), flush=True)
    (args.work / "data_prep_limited.json").write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 50_000, 200_000, 1_000_000])
    parser.add_argument("--procs", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--memory-limit-mib", type=int, help="jobgen alone, on the last --rows, in a memory cgroup")
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    from jobgen.cli.tinymodel import make_tiny_model

    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, **SHAPE)
    pool = single_token_words(model)
    if args.memory_limit_mib:
        bigger_than_memory(args, model, pool, env)
        return
    cpus = len(os.sched_getaffinity(0))
    results = {"machine": f"{platform.node()}: {cpus} CPUs", "procs": args.procs, "runs": []}
    for rows in args.rows:
        data = args.work / f"alpaca-{rows}.jsonl"
        if not data.exists():
            make_data(data, pool, rows, seed=1)
        run = {"rows": rows, "file_mb": round(data.stat().st_size / 1e6)}
        for which in ("jobgen", "hf"):
            out = args.work / f"out-{which}-{rows}"
            shutil.rmtree(out, ignore_errors=True)
            run[which] = run_measured(CHILD, [which, str(model), str(data), str(out), str(args.procs)], env)
            shutil.rmtree(out, ignore_errors=True)
        run["time_ratio"] = round(run["jobgen"]["seconds"] / run["hf"]["seconds"], 2)
        run["memory_ratio"] = round(run["jobgen"]["peak_mib"] / run["hf"]["peak_mib"], 2)
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
    first = args.work / f"alpaca-{args.rows[0]}.jsonl"
    alone = run_measured(TOKENIZER_ALONE, [str(model), str(first)], {**env, "TOKENIZERS_PARALLELISM": "false"})
    results["tokenizer_alone_tokens_per_s_per_core"] = round(alone["tokens_per_s"])

    print(f"{results['machine']}; {args.procs} tokenizing processes each")
    header = f"{'rows':>9} {'MB':>6} | {'jobgen s':>8} {'MiB':>6} {'tok/s/core':>10} | {'HF s':>6} {'MiB':>6}"
    print(header + " | time x  mem x")
    for run in results["runs"]:
        ours, theirs = run["jobgen"], run["hf"]
        per_core = ours["tokens"] / ours["seconds"] / args.procs
        run["jobgen"]["tokens_per_s_per_core"] = round(per_core)
        print(
            f"{run['rows']:>9,} {run['file_mb']:>6} | {ours['seconds']:>8.1f} {ours['peak_mib']:>6} "
            f"{per_core:>10,.0f} | {theirs['seconds']:>6.1f} {theirs['peak_mib']:>6} | "
            f"{run['time_ratio']:>6.2f} {run['memory_ratio']:>6.2f}"
        )
    print(f"the tokenizer alone, one core: {results['tokenizer_alone_tokens_per_s_per_core']:,} tokens/s")
    growth = results["runs"][-1]["jobgen"]["peak_mib"] / results["runs"][0]["jobgen"]["peak_mib"]
    print(f"jobgen's peak memory at {args.rows[-1]:,} rows is {growth:.2f}x that at {args.rows[0]:,}")
    (args.work / "data_prep.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
