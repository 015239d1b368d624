"""A Hugging Face Trainer script of the shape of transformers'
``examples/pytorch/language-modeling/run_clm.py``, written for jobgen's tests, which run it
as a user's program exactly as it is and never edit it (it knows nothing of jobgen):

    python run_clm_like.py --model_name_or_path MODEL --train_file DATA.jsonl \
        --output_dir OUT --max_steps 16 --save_steps 4 [--resume_from_checkpoint OUT/checkpoint-N]

Arguments through ``HfArgumentParser`` with ``TrainingArguments``; the rows of an
instruction JSONL (instruction, input, output) concatenated and cut into blocks as
run_clm's ``group_texts`` does; ``trainer.train(resume_from_checkpoint=...)`` with what the
command line gave; then ``trainer.save_model()`` and a line in ``OUT/final.txt`` ("final"
marker) as a script's post-training code does.
"""

import logging
import os
from dataclasses import dataclass, field
from itertools import chain

import torch
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local model directory"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "a JSONL file of instruction, input, output rows"})
    block_size: int = field(default=64, metadata={"help": "tokens per training example"})


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(
        "output_dir %s, resume_from_checkpoint %s", training_args.output_dir, training_args.resume_from_checkpoint
    )
    set_seed(training_args.seed)

    raw = load_dataset("json", data_files=data_args.train_file, split="train")
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)

    def tokenize(rows):
        texts = [f"{i}\n{x}\n{o}" for i, x, o in zip(rows["instruction"], rows["input"], rows["output"])]
        return tokenizer(texts)

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined["input_ids"]) // data_args.block_size) * data_args.block_size
        blocks = {
            k: [t[i : i + data_args.block_size] for i in range(0, total, data_args.block_size)]
            for k, t in joined.items()
        }
        blocks["labels"] = blocks["input_ids"].copy()
        return blocks

    with training_args.main_process_first(desc="dataset map pre-processing"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
        lm_dataset = tokenized.map(group_texts, batched=True)

    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=lm_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()  # the "final" model, into output_dir

    metrics = train_result.metrics
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "final.txt"), "a") as marker:
            marker.write(f"final at step {trainer.state.global_step}\n")


if __name__ == "__main__":
    main()
