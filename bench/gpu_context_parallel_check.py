"""Context parallel equivalence on a GPU: the CUDA kernels (``--attention sdpa``: SDPA's
memory-efficient attention with the dense document-causal mask; ``--attention flex_attention``:
compiled flex_attention with the block mask) give the loss and gradients of the unsharded model.

tests/distributed/test_context_parallel.py proves the SDPA path's equivalence on CPU (gloo,
float32) in CI, and the flex path's forward only (torch 2.13's flex_attention has no backward on
CPU); this is the same check where the trainer uses it, on CUDA, backward included. Two ranks
share the GPU(s) round-robin with the gloo backend (NCCL refuses two ranks on one device; K/V
then travel through host memory). A random Llama (hidden 256, 4 layers, 4 query and 2 key/value
heads) gets two packed rows of ``--max-length`` tokens with several documents each. Each rank
computes the reference (the model's own attention, ``--reference``: sdpa unless told otherwise,
on the whole rows) and its context-parallel share; the shares' loss sums and gradients are
summed over the ranks and compared, in float32, under bf16 autocast, and in float32 again with
activation checkpointing on the sharded model (attention runs again in backward, from the same
mask). ``--compile`` compiles the sharded model's decoder blocks first, as ``train.compile``
does on GPUs. Prints the largest differences and exits 1 when float32's exceed the tolerance.

On a machine with a GPU (one is enough):

    python3 bench/gpu_context_parallel_check.py --max-length 4096
    python3 bench/gpu_context_parallel_check.py --max-length 4096 --attention flex_attention
    python3 bench/gpu_context_parallel_check.py --max-length 4096 --attention flex_attention --reference flex_attention

``--device cpu`` is a dry run of the script (SDPA only: flex has no backward on CPU, and the
script says so before it starts).
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

    from trainer.data.packing import collate

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
    """The unsharded model against this rank's share, summed over the ranks, under ``precision``
    ("float32" or "bf16"; a "-checkpointed" suffix names the run, the caller turned it on)."""
    import torch
    import torch.distributed as dist

    from trainer.data.packing import model_inputs, token_loss_sum

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision.startswith("bf16"))
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


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.parallel.context_parallel import FLEX_ATTENTION, ContextParallel

    dist.init_process_group("gloo")
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, vocab_size=2048, max_position_embeddings=args.max_length, use_cache=False)
    reference = LlamaForCausalLM(config).to(device)
    reference.set_attn_implementation(args.reference)
    sharded = LlamaForCausalLM(copy.deepcopy(config)).to(device)  # install() changes its config
    sharded.load_state_dict(reference.state_dict())
    cp = ContextParallel(dist.group.WORLD, attention=args.attention)
    cp.install(sharded)
    kernel = "flex_attention" if sharded.config._attn_implementation == FLEX_ATTENTION else "sdpa"
    if args.compile:
        for layer in sharded.model.layers:  # as trainer.model.prep.compile_decoder_blocks
            layer.compile()
    batch = rows(args.max_length)
    report = {p: compare(reference, sharded, cp, batch, device, p) for p in ("float32", "bf16")}
    sharded.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sharded.train()
    report["float32-checkpointed"] = compare(reference, sharded, cp, batch, device, "float32-checkpointed")
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"kernel": kernel, **report}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of the script")
    parser.add_argument(
        "--attention", choices=["sdpa", "flex_attention"], default="sdpa", help="the context-parallel kernel"
    )
    parser.add_argument(
        "--reference", choices=["sdpa", "flex_attention"], default="sdpa", help="the unsharded model's attention"
    )
    parser.add_argument("--compile", action="store_true", help="compile the sharded model's decoder blocks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if "flex_attention" in (args.attention, args.reference) and args.device == "cpu":  # torch 2.13: no backward
        sys.path.insert(0, str(REPO))
        from trainer.parallel.context_parallel import flex_backward_error

        error = flex_backward_error(args.device)
        if error:
            raise SystemExit(f"cannot check flex_attention's gradients here: {error}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "report.json")
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={args.ranks}"]
        cmd += [__file__, "--worker", "--max-length", str(args.max_length), "--out", out, "--device", args.device]
        cmd += ["--attention", args.attention, "--reference", args.reference] + (["--compile"] if args.compile else [])
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        report = json.loads(Path(out).read_text())
    head = {"max_length": args.max_length, "ranks": args.ranks, "attention": args.attention}
    head |= {"reference": args.reference, "compile": args.compile}
    print(json.dumps({**head, **report}, indent=1))
    if report["kernel"] != args.attention:
        print(f"context parallel ran {report['kernel']}, not {args.attention}: NO")
        sys.exit(1)
    ok = all(
        report[p]["loss_per_token_diff"] < TOLERANCE and report[p]["max_grad_diff_relative"] < TOLERANCE
        for p in ("float32", "float32-checkpointed")
    )
    print(
        f"context parallel ({args.attention}) on {args.device} equals the unsharded model ({args.reference}, float32):",
        "yes" if ok else "NO",
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
