"""A random tiny Llama-style model and a tokenizer trained here: tests and demos need no hub.

    jobgen make-tiny-model DIR [--hidden-size 64] [--layers 2] [--vocab-size 512] [--seed 0]

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the
project's example data plus a fixed corpus, with ``<s>``/``</s>``/``<pad>`` and a
ChatML chat template, saved as a ``PreTrainedTokenizerFast``. The model is a
``LlamaForCausalLM`` with random weights from ``seed``. Both are written into a
temporary directory next to DIR and renamed into place, so DIR is either complete
or absent. Imports torch and transformers: only this command and the trainer do.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from jobgen.base.atomic import staged_directory
from jobgen.base.paths import EXAMPLES_DIR

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

# ChatML; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_FIXED_CORPUS = [
    "### Instruction:\n",
    "### Input:\n",
    "### Response:\n",
    "### Label:",
    "Below is an instruction.",
    "The quick brown fox jumps over the lazy dog.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "system user assistant",
    "You are a helpful assistant.",
]


def _corpus() -> list[str]:
    texts = list(_FIXED_CORPUS)
    paths = sorted((EXAMPLES_DIR / "data").glob("*.jsonl"))
    if not paths:  # the tokenizer would be another one, silently: the package is incomplete
        raise click.ClickException(f"no example data in {EXAMPLES_DIR / 'data'}: reinstall jobgen")
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for value in row.values():
                if isinstance(value, str):
                    texts.append(value)
                elif isinstance(value, list):
                    texts.extend(m.get("content", "") for m in value if isinstance(m, dict))
    return texts


def train_tokenizer(vocab_size: int):
    """A byte-level BPE over the corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        padding_side="right",
    )


def make_tiny_model(
    target: Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    vocab_size: int = 512,
    seed: int = 0,
    intermediate_size: int | None = None,
    kv_heads: int | None = None,
    model_vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    device: str = "cpu",
    max_shard_size: str = "5GB",
) -> Path:
    """Write tokenizer + random LlamaForCausalLM to ``target`` atomically; return it.

    The defaults are the tests' tiny model. Benchmarks build real shapes with the same
    tokenizer: ``intermediate_size`` (default 2 x hidden), ``kv_heads`` (default heads/2),
    ``model_vocab_size`` (rows of the embedding, default the tokenizer's size), the weights'
    ``dtype``, the ``device`` they are initialised on (a 7B model initialises in seconds on
    a GPU, minutes on a CPU) and the safetensors' ``max_shard_size``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = Path(target)
    with staged_directory(target) as staging:
        tokenizer = train_tokenizer(vocab_size)
        tokenizer.save_pretrained(staging)
        config = LlamaConfig(
            vocab_size=model_vocab_size or len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size or hidden_size * 2,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or max(1, heads // 2),
            max_position_embeddings=max_position_embeddings,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(staging, safe_serialization=True, max_shard_size=max_shard_size)
        del model
    return target
