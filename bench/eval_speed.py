"""Evaluation speed against training speed, on the same model and data, in one run.

The model, data, max_length and micro-batch are those of bench/throughput_cpu.py (a random
Llama of hidden 512 with a 32k vocabulary; alpaca-shaped rows, about 40 % of the tokens
targets). One jobgen run, packed, evaluates a held-out file of ``--eval-examples`` rows drawn
the same way every ``--every`` steps; both rates are in target tokens per second (the tokens
a loss is taken on): training's over the timed steps (``step_target_tokens`` /
``step_seconds``), evaluation's over each evaluation (``eval_tokens`` / ``eval_seconds``).
A forward without gradients is about a third of a training step's compute, so evaluation
should run at 2.5x training's rate or more.

    .venv/bin/python bench/eval_speed.py [--work DIR] [--steps 20] [--eval-examples 200] [--every 10]

Prints both rates and their ratio, and writes ``DIR/eval_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from throughput_cpu import SHAPE, make_data, run_trainer, single_token_words

from helpers import read_jsonl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing starts")
    parser.add_argument("--examples", type=int, default=4000, help="training examples")
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="evaluate every N steps")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--procs", type=int, default=1, help="processes (ranks)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="jobgen-eval-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        from jobgen.cli.tinymodel import make_tiny_model

        make_tiny_model(model, **SHAPE)
    data, valid = work / "alpaca-shaped.jsonl", work / "alpaca-shaped-valid.jsonl"
    words = single_token_words(model)
    if not data.exists():
        make_data(data, words, args.examples, seed=7)
    if not valid.exists():
        make_data(valid, words, args.eval_examples, seed=8)
    run = run_trainer(
        work,
        "eval-speed",
        args,
        model={"path": model},
        data={"path": data, "max_length": args.max_length, "packing": True},
        train={
            "micro_batch_size": args.micro_batch,
            "lr": 1e-4,
            "max_steps": args.steps + args.warmup,
            "save_every_steps": 0,
            "log_every_steps": 1,
            "seed": 1,
        },
        eval={"path": valid, "every_steps": args.every, "at_end": False},
    )
    lines = read_jsonl(run / "metrics.jsonl")
    steps = [m for m in lines if m.get("event") != "eval" and m["step"] > args.warmup]
    evals = [m for m in lines if m.get("event") == "eval"]
    train_rate = sum(m["step_target_tokens"] for m in steps) / sum(m["step_seconds"] for m in steps)
    eval_rates = [m["eval_tokens"] / m["eval_seconds"] for m in evals]
    eval_rate = statistics.median(eval_rates)
    ratio = eval_rate / train_rate
    print(f"training   {train_rate:8.0f} target tokens/s over {len(steps)} steps")
    print(f"evaluation {eval_rate:8.0f} target tokens/s (median of {len(evals)}: {[round(r) for r in eval_rates]})")
    print(f"ratio      {ratio:.2f}x (target >= 2.5x)")
    report = {
        "shape": SHAPE,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "train_target_tokens_per_s": round(train_rate, 1),
        "eval_target_tokens_per_s": [round(r, 1) for r in eval_rates],
        "eval_tokens": evals[0]["eval_tokens"] if evals else None,
        "ratio": round(ratio, 2),
    }
    (work / "eval_speed.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {work / 'eval_speed.json'}")


if __name__ == "__main__":
    main()
