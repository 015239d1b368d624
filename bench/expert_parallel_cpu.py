"""Tokens/s of a mixture of experts with and without expert parallelism, on the dev cluster (CPU).

A Mixtral-shaped model (8 experts, top-2, 4 layers of hidden 256), trained by FSDP on 2 nodes
x 2 processes (gloo), with ``train.expert_parallel`` = 1 (every rank's FSDP unit gathers all
of a layer's experts and runs the ones its tokens chose), 2 and 4 (each rank holds 4 or 2
experts and the tokens travel to them by all-to-all), the same data and global batch.
Reported, from the same invocation: the median useful tokens/s over the measured steps
(metrics.jsonl's ``tokens_per_s``), the bytes the nodes sent each step (the veth counters),
and each run's ratio to ep 1. On this machine the 4 ranks share 2 cores: the ratios, not the
rates, are what carries over, and a GPU's all-to-all runs on NVLink (bench/gpu_proofs.sh).

On the dev cluster as the test session starts it (``jobgen cluster up --netns --nodes 3
--cpus-per-node 4``, as root), when nothing else uses it (about 5 minutes):

    .venv/bin/python bench/expert_parallel_cpu.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from cluster_counts import bytes_and_rate, sent_bytes

from helpers import submit, train_spec

NODES = ("node1", "node2")
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
}


def make_model(directory: Path) -> Path:
    """A random Mixtral of SHAPE with jobgen's tiny tokenizer, saved as the hub lays it out."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from jobgen.cli.tinymodel import train_tokenizer

    tokenizer = train_tokenizer(512)
    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    ids |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mixtral", **SHAPE, **ids), dtype=torch.float32)
    tokenizer.save_pretrained(directory)
    model.save_pretrained(directory)
    return directory


def measure(work: Path, model: Path, ep: int, steps: tuple[int, int]) -> tuple[float, float]:
    """(bytes across the nodes per step, median useful tokens/s) of one run between two steps."""
    name = f"bench-ep{ep}"
    spec = train_spec(
        work,
        model,
        name,
        nodes=2,
        procs_per_node=2,
        job={"nodelist": list(NODES)},
        micro_batch_size=2,
        max_steps=steps[1] + 2,
        save_every="24h",
        parallelism="fsdp",
        expert_parallel=ep,
    )
    submit(spec)
    return bytes_and_rate(work / "runs" / name, steps, lambda: sent_bytes(NODES), name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=3, help="the step the count starts at")
    parser.add_argument("--last", type=int, default=12, help="the step it ends at")
    args = parser.parse_args()
    steps = (args.first, args.last)
    with tempfile.TemporaryDirectory(prefix="jobgen-ep-") as tmp:
        work = Path(tmp)
        model = make_model(work / "model")
        results = {ep: measure(work, model, ep, steps) for ep in (1, 2, 4)}
    base = results[1][1]
    for ep, (per_step, rate) in results.items():
        print(
            f"expert_parallel {ep}: {rate:.0f} useful tokens/s ({rate / base:.2f}x ep 1), "
            f"{per_step / 2**20:.2f} MiB across the nodes per step"
        )
    print(f"2 nodes x 2 processes, fsdp, steps {args.first}-{args.last}; model mixtral {SHAPE}")


if __name__ == "__main__":
    main()
