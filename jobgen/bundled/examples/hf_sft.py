"""A Hugging Face ``Trainer`` SFT script that jobgen runs with its launch and lifecycle
(``[job] program = "command"``): the time limit's signal saves and stops it, the next
array task resumes from that checkpoint, the switches and ``jobgen status`` work.

    jobgen make-tiny-model examples/tiny-model
    jobgen submit examples/hf_sft.toml

jobgen adds two lines to a plain Trainer script: ``callbacks=[JobgenCallback()]`` and
``resume_from_checkpoint=resume_checkpoint(...)``; checkpoints go to the run directory.
"""

import argparse

import torch
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

from jobgen import runtime
from jobgen.runtime.hf import JobgenCallback, resume_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a local model directory")
    parser.add_argument("--data", required=True, help="alpaca-style JSONL: instruction, input, output")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-steps", type=int, default=50)
    args = parser.parse_args()

    job = runtime.current()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    def encode(row):
        prompt = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
        return tokenizer(f"{prompt}\n{row['output']}{tokenizer.eos_token}", truncation=True, max_length=256)

    training = TrainingArguments(
        output_dir=str(job.checkpoint_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        report_to="none",
        seed=1234,
        use_cpu=not torch.cuda.is_available(),
    )
    with training.main_process_first():
        data = load_dataset("json", data_files=args.data, split="train")
        data = data.map(encode, remove_columns=data.column_names)
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(args.model),
        args=training,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=[JobgenCallback(job)],
    )
    trainer.train(resume_from_checkpoint=resume_checkpoint(training.output_dir))


if __name__ == "__main__":
    main()
