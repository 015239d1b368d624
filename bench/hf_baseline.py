"""The baseline a user would write: a Hugging Face ``Trainer`` SFT script, timed step by step.

Tokenizes alpaca rows with the Alpaca prompt (the same text jobgen's trainer builds), sets
``labels`` to a copy of ``input_ids`` (as the common hand-written script does), and trains
with ``Trainer`` on CPU, padding each batch either to ``max_length`` (baseline A) or to the
longest example in the batch (baseline B). Run by ``bench/throughput_cpu.py``, one process
per baseline; by hand:

    .venv/bin/python bench/hf_baseline.py --model DIR --data FILE --padding longest \\
        --max-length 512 --micro-batch 4 --steps 30 --warmup 3 --out result.json

Writes ``{"steps", "useful_tokens", "total_tokens", "seconds", "peak_rss_mib"}`` over the
timed steps (after ``--warmup``): useful tokens are the non-padding ones. ``--cuda`` trains
on the GPU in bf16 (bench/throughput_gpu.py) and adds ``peak_gpu_mib``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--padding", choices=["max_length", "longest"], required=True)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--cuda", action="store_true", help="train on the GPU in bfloat16 (model loaded in bf16, bf16=True)"
    )
    args = parser.parse_args()

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from trainer.data.formats import alpaca_segments

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]

    def encode(row: dict) -> dict:
        text = "".join(piece for piece, _ in alpaca_segments(row, "row")) + tokenizer.eos_token
        out = tokenizer(text, truncation=True, max_length=args.max_length)
        return {"input_ids": out["input_ids"]}

    dataset = datasets.Dataset.from_list([encode(r) for r in rows])
    pad = tokenizer.pad_token_id

    def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
        width = args.max_length if args.padding == "max_length" else max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
            mask[i, : len(b["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    # On a GPU, what the usual script does: weights loaded in bf16, Trainer's bf16 autocast.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if args.cuda else torch.float32)
    model.config.use_cache = False
    timings: list[tuple[float, int, int]] = []

    class TimedTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            started = time.perf_counter()
            loss = super().training_step(model, inputs, num_items_in_batch)
            timings.append(
                (time.perf_counter() - started, int(inputs["attention_mask"].sum()), int(inputs["input_ids"].numel()))
            )
            return loss

    training_args = TrainingArguments(
        output_dir=str(args.out.parent / f"hf-{args.padding}"),
        per_device_train_batch_size=args.micro_batch,
        max_steps=args.steps + args.warmup,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=not args.cuda,
        bf16=args.cuda,
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
    )
    # The optimizer step is outside training_step: time whole steps by the clock between them.
    step_marks: list[float] = []

    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_step_end(self, *_args, **_kwargs):
            if args.cuda:
                torch.cuda.synchronize()  # the clock must not run ahead of the queued kernels
            step_marks.append(time.perf_counter())

    trainer = TimedTrainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collate, callbacks=[Marks()]
    )
    trainer.train()
    timed = timings[args.warmup :]
    seconds = step_marks[-1] - step_marks[args.warmup - 1] if args.warmup else step_marks[-1] - step_marks[0]
    result = {
        "steps": len(timed),
        "useful_tokens": sum(t[1] for t in timed),
        "total_tokens": sum(t[2] for t in timed),
        "seconds": seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if args.cuda:
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    args.out.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
