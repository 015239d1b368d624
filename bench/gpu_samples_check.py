"""GPU check of the samples a person reads (``[eval] prompts``): greedy answers generated
through flex attention with compiled decoder blocks, as a GPU site trains by default.

On a GPU, a run with packed rows resolves ``model.attention = "auto"`` to flex attention and
``train.compile`` to compiled decoder blocks; the samples at each evaluation then run the same
modules with a KV cache, one token at a time: every new length is a new shape for the compiled
blocks and a new mask for flex attention. CI cannot see this path (torch's flex_attention has
no backward on CPU). Two runs of the real trainer on the same random Llama (hidden 256, 4
layers, bf16), data and seed, each 2 optimizer steps at a learning rate too small to move a
bf16 weight, then the evaluation at the end with 3 prompts of ``--new-tokens`` tokens each:

- ``flex-compiled``: the GPU site's defaults (flex attention, compiled blocks);
- ``sdpa-eager``: ``model.attention = "sdpa"``, ``train.compile = false``.

Checks: both runs finish and answer every prompt with at least one token; the first run's log
says it trained with flex attention and compiled blocks. Printed, not checked: the share of
tokens the two runs' answers agree on before the first difference (bf16 kernels differ in the
last bits; a random model's logits are close, so greedy answers may part early) and seconds
per generated token of each (a recompilation per token would show here).

    .venv/bin/python bench/gpu_samples_check.py [--work DIR] [--new-tokens 32] [--json FILE]

``--smoke`` runs the first on CPU (where it resolves to SDPA, eager: the script, not the kernel). Exit status 0 when
every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_run import prepared_run, random_bf16_model, write_result

from helpers import DATA, torchrun

SMALL = {"hidden_size": 256, "layers": 4, "intermediate_size": 704, "heads": 4, "kv_heads": 2}
PROMPTS = ["Name three primary colors.", "Write a haiku about rain.", "What is 12 times 7?"]
RUNS = {
    "flex-compiled": {"model": {}, "train": {}},
    "sdpa-eager": {"model": {"attention": "sdpa"}, "train": {"compile": False}},
}


def one_run(work: Path, model: Path, name: str, args: argparse.Namespace) -> dict:
    """Train and evaluate once; the answers, their timing and what the trainer said it used."""
    extra = RUNS[name]
    run, _ = prepared_run(
        work,
        name,
        site="local" if args.smoke else {"profile": "local", "slurm": {"gpus_per_node": 1}},
        model={"path": model, "dtype": "bfloat16", **extra["model"]},
        data={"path": DATA, "max_length": 512, "packing": True},
        train={
            "parallelism": "fsdp",
            "micro_batch_size": 2,
            "lr": 1e-9,
            "max_steps": 2,
            "save_every_steps": 0,
            "log_every_steps": 1,
            "seed": 1,
            **extra["train"],
        },
        eval={"split": 0.05, "max_batches": 1, "prompts": PROMPTS, "max_new_tokens": args.new_tokens},
    )
    proc = torchrun(run, nproc=1, timeout=1200)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return {"name": name, "error": f"the trainer exited {proc.returncode}", "tail": log[-3000:]}
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
    answers = {s["prompt"]: s for s in samples}  # the last evaluation's answer to each prompt
    tokens = sum(s["tokens"] for s in answers.values())
    return {
        "name": name,
        "answers": {p: answers[p]["completion"] for p in answers},
        "tokens": {p: answers[p]["tokens"] for p in answers},
        "seconds_per_token": round(sum(s["seconds"] for s in answers.values()) / max(1, tokens), 4),
        "flex": "attention: flex_attention" in log,
        "compiled": "compiled decoder blocks" in log,
    }


def leading_agreement(a: str, b: str) -> float:
    """The share of the longer answer's characters before the two first differ (1 when equal)."""
    if a == b:
        return 1.0
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(1, len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--new-tokens", type=int, default=32, help="eval.max_new_tokens")
    parser.add_argument("--smoke", action="store_true", help="CPU: checks the script, not the kernel")
    parser.add_argument("--json", type=Path, default=None, help="write the figures and checks here")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="jobgen-samples-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model-small"
    random_bf16_model(model, SMALL, max_positions=1024)
    # On a CPU both would be SDPA, eager: the smoke run makes the first only.
    results = {name: one_run(work, model, name, args) for name in (["flex-compiled"] if args.smoke else RUNS)}
    for r in results.values():
        if "error" in r:
            print(f"{r['name']}: {r['error']}\n{r['tail']}")
            continue
        print(f"{r['name']}: {sum(r['tokens'].values())} tokens, {r['seconds_per_token'] * 1000:.1f} ms per token")
        for prompt, answer in r["answers"].items():
            print(f"  {prompt!r} -> {answer[:80]!r}")
    ok = not any("error" in r for r in results.values())
    flex, sdpa = results["flex-compiled"], results.get("sdpa-eager")
    agreement = None
    if ok and sdpa:
        shares = [leading_agreement(flex["answers"].get(p, ""), sdpa["answers"].get(p, "")) for p in PROMPTS]
        agreement = round(sum(shares) / len(shares), 3)
        print(f"answers agree on {agreement:.0%} of their length before the first difference")
    answered = all(r["tokens"].get(p, 0) > 0 for r in results.values() for p in PROMPTS)
    checks = {"every run answered every prompt": ok and answered}
    if not args.smoke:
        checks["the first run used flex attention and compiled blocks"] = ok and flex["flex"] and flex["compiled"]
    for what, passed in checks.items():
        print(f"{'ok  ' if passed else 'FAIL'} {what}")
    figures = {
        "flex_ms_per_token": round(flex["seconds_per_token"] * 1000, 1) if ok else None,
        "sdpa_ms_per_token": round(sdpa["seconds_per_token"] * 1000, 1) if ok and sdpa else None,
        "leading_agreement": agreement,
    }
    write_result(args.json, {"figures": figures, "checks": checks})
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
