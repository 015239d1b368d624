"""``jobgen plan`` for two published mixtures of experts on H100 nodes, per expert-parallel degree.

Mixtral-8x7B (8 experts, top-2) and gpt-oss-120b (128 experts, top-4), counted from their
config.json alone (the published numbers, written here: nothing is downloaded), full
fine-tuning with FSDP on the bundled ``h100-ib`` site (8 x 80 GB per node), 1 and 2 nodes,
gradient checkpointing, one row of ``--max-length`` tokens per rank, each with
``train.expert_parallel`` = 1, 2, 4, 8. Printed: each rank's predicted peak, what the verdict
adds (NCCL, context, fragmentation), the verdict, and the plan's own suggestion when the run
does not fit. seed 004 (fms-hf-tuning) trains these with FSDP and ``--fast_moe`` expert
parallelism of the node's 8 GPUs (ep 8 on 1 x 8; ep 8 with 2 replicas on 2 x 8).

    .venv/bin/python bench/plan_moe.py [--max-length 4096]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jobgen.base.sizes import GIB  # noqa: E402

MODELS = {
    # mistralai/Mixtral-8x7B-v0.1's config.json (the fields the count reads)
    "Mixtral-8x7B": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # openai/gpt-oss-120b's config.json (its experts as they train: dequantized to bf16)
    "gpt-oss-120b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 201088,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
DATA = REPO / "jobgen" / "bundled" / "examples" / "data" / "instructions.jsonl"


def spec_text(model: Path, nodes: int, ep: int, max_length: int) -> str:
    return f"""
site = "h100-ib"
[job]
name = "plan-moe"
nodes = {nodes}
procs_per_node = 8
time = "24h"
[model]
path = "{model}"
gradient_checkpointing = true
[data]
path = "{DATA}"
max_length = {max_length}
[train]
parallelism = "fsdp"
micro_batch_size = 1
expert_parallel = {ep}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-length", type=int, default=4096)
    args = parser.parse_args()
    from jobgen.plan.memory_plan import plan_run
    from jobgen.spec.loader import load_run

    work = Path(tempfile.mkdtemp(prefix="plan-moe-"))
    print("| model | nodes x GPUs | expert_parallel | experts a rank | peak GiB | + headroom | verdict | suggestion |")
    print("|---|---|---|---|---|---|---|---|")
    for name, config in MODELS.items():
        model = work / name
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        for nodes in (1, 2):
            for ep in (1, 2, 4, 8):
                spec_file = work / f"{name}-{nodes}-{ep}.toml"
                spec_file.write_text(spec_text(model, nodes, ep, args.max_length))
                plan = plan_run(load_run(spec_file))
                suggestion = plan.suggestions[0].change if plan.suggestions else ""
                print(
                    f"| {name} | {nodes} x 8 | {ep} | {config['num_local_experts'] // ep} | {plan.peak / GIB:.1f} "
                    f"| {plan.reserve / GIB:.1f} | {plan.verdict} | {suggestion} |"
                )


if __name__ == "__main__":
    main()
