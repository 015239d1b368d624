"""Context parallel equivalence on a GPU: the CUDA kernels (SDPA's memory-efficient attention
with the document-causal mask, bf16 autocast) give the loss and gradients of the unsharded model.

tests/distributed/test_context_parallel.py proves the equivalence on CPU (gloo, float32) in CI;
this is the same check where the trainer uses it, on CUDA. Two ranks share the GPU(s) round-
robin with the gloo backend (NCCL refuses two ranks on one device; K/V then travel through host
memory). A random Llama (hidden 256, 4 layers, 4 query and 2 key/value heads) gets two packed
rows of ``--max-length`` tokens with several documents each. Each rank computes the reference
(the model's own sdpa attention, the whole rows) and its context-parallel share; the shares'
loss sums and gradients are summed over the ranks and compared, in float32 and under bf16
autocast. Prints the largest differences and exits 1 when float32's exceed the tolerance.

On a machine with a GPU (one is enough):

    python3 bench/gpu_context_parallel_check.py --max-length 4096
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
TOLERANCE = 1e-4  # float32 on CUDA: the kernels' sums run in other orders than the reference's


def rows(max_length: int):
    import torch

    from trainer.packing import collate

    g = torch.Generator().manual_seed(1)
    out = []
    for sizes in (
        [max_length // 2, max_length // 3, max_length // 7],
        [max_length // 5, max_length - 9 - max_length // 5],
    ):
        docs = []
        for n in sizes:
            ids = torch.randint(0, 2048, (n,), generator=g).tolist()
            docs.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})
        out.append(docs)
    return collate(out, pad_token_id=0, packing=True)


def compare(reference, sharded, cp, batch, device, precision: str) -> dict[str, float]:
    """The unsharded model against this rank's share, summed over the ranks, under ``precision``."""
    import torch
    import torch.distributed as dist

    from trainer.packing import model_inputs, token_loss_sum

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    reference.zero_grad(set_to_none=True)
    with autocast:
        logits = reference(**model_inputs({k: v.to(device) for k, v in batch.items()})).logits
    ref_sum, ref_count = token_loss_sum(logits.float(), batch["labels"].to(device))
    ref_sum.backward()
    sharded.zero_grad(set_to_none=True)
    local = cp.shard(batch)
    with cp.active(local):  # backward inside: checkpointed attention would run again
        with autocast:
            logits = sharded(**local.model_inputs(device)).logits
        my_sum, my_count = cp.loss_sum(logits.float(), local.labels.to(device))
        my_sum.backward()
    totals = torch.tensor([float(my_sum), float(my_count)], dtype=torch.float64)
    dist.all_reduce(totals)
    worst = 0.0
    for mine, ref in zip(sharded.parameters(), reference.parameters()):
        grad = mine.grad.detach().float().clone()
        dist.all_reduce(grad)
        worst = max(worst, float((grad - ref.grad.float()).abs().max()) / max(float(ref.grad.abs().max()), 1e-12))
    return {
        "loss_per_token_diff": abs(float(totals[0]) / float(totals[1]) - float(ref_sum) / float(ref_count)),
        "targets": [float(totals[1]), float(ref_count)],
        "max_grad_diff_relative": worst,
    }


def worker(max_length: int, out: str, device_type: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.context_parallel import ContextParallel

    dist.init_process_group("gloo")
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, vocab_size=2048, max_position_embeddings=max_length, use_cache=False)
    reference = LlamaForCausalLM(config).to(device)
    sharded = LlamaForCausalLM(copy.deepcopy(config)).to(device)  # install() changes its config
    sharded.load_state_dict(reference.state_dict())
    cp = ContextParallel(dist.group.WORLD)
    cp.install(sharded)
    batch = rows(max_length)
    report = {p: compare(reference, sharded, cp, batch, device, p) for p in ("float32", "bf16")}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of the script")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.max_length, args.out, args.device)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "report.json")
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={args.ranks}"]
        cmd += [__file__, "--worker", "--max-length", str(args.max_length), "--out", out, "--device", args.device]
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        report = json.loads(Path(out).read_text())
    print(json.dumps({"max_length": args.max_length, "ranks": args.ranks, **report}, indent=1))
    float32 = report["float32"]
    ok = float32["loss_per_token_diff"] < TOLERANCE and float32["max_grad_diff_relative"] < TOLERANCE
    print("context parallel on CUDA equals the unsharded model (float32):", "yes" if ok else "NO")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
