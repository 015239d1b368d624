"""Samples a person can read: greedy answers to ``[eval] prompts`` at every evaluation.

Each prompt goes through the tokenizer's chat template as one user turn (the raw text when
the tokenizer has none) and is answered greedily, up to ``max_new_tokens`` or the end of
turn, with a KV cache. Under FSDP2 every rank runs every forward (each one all-gathers the
layers it needs); rank 0's choice of each token is broadcast, so all ranks feed the same
token and stop on the same step even if their logits differed in the last bit. Under DDP
(every rank holds the whole model) rank 0 alone generates while the others wait.

Between prompts the ranks agree on the stop action (one small all-reduce): a stop during
the samples leaves the rest unwritten and the loop saves and exits. Rank 0 appends a line
per prompt to ``samples.jsonl`` (step, prompt, completion, tokens) and a text table to the
trackers; ``jobgen samples RUN`` prints them side by side across steps.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from jobgen.runtime.stopping import Action, StopMonitor
from trainer.distributed import DistEnv, barrier, mark_progress, reduce_max
from trainer.memory.chunked_loss import unwrap


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the model sees it at inference: one user turn through the chat template,
    ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def stop_token_ids(tokenizer, model: torch.nn.Module) -> set[int]:
    """End of text and end of turn: the tokenizer's eos and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
    return ids


class SampleGenerator:
    """Greedy answers to the run's prompts, from every rank where the model is sharded."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        prompts: list[str],
        max_new_tokens: int,
        env: DistEnv,
        monitor: StopMonitor,
        samples_file,
        greedy_token: Callable[[torch.Tensor], int] | None = None,
    ):
        """``greedy_token``: the next token of one row, agreed by every rank, for a model whose
        forward is not the whole model's (a pipeline's stages, trainer.parallel.pipeline_forward):
        then every rank takes part and the row is run whole for each token (no cache)."""
        self.greedy_token = greedy_token
        self.model = model
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.env = env
        self.monitor = monitor
        self.samples_file = samples_file
        # DDP: each rank holds the whole model, rank 0 answers alone; FSDP: every rank takes part.
        self.alone = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.stops = stop_token_ids(tokenizer, model)
        # transformers 5 renamed the forward's cache argument; older releases know the old name.
        forward = inspect.signature(unwrap(model).forward).parameters
        self.cache_argument = "cache" if "cache" in forward else "past_key_values"

    def generate(self, step: int) -> tuple[list[dict[str, Any]] | None, Action]:
        """Answer every prompt (collective); (the records, CONTINUE), or (None, the stop action)
        when a stop was asked for in between."""
        records: list[dict[str, Any]] = []
        self.model.eval()
        try:
            for prompt in self.prompts:
                started = time.time()
                ids: list[int] = []
                if self.env.is_main or not self.alone:
                    ids = self._answer(prompt_ids(self.tokenizer, prompt))
                text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.env.is_main else ""
                seconds = round(time.time() - started, 3)
                record = {"step": step, "prompt": prompt, "completion": text, "tokens": len(ids)}
                records.append({**record, "seconds": seconds})
                (action,) = reduce_max(self.env, [int(self.monitor.local_action())])
                mark_progress()
                if Action(action).exits:
                    return None, Action(action)
        finally:
            self.model.train()
        if self.env.is_main:
            self._append(records)
        barrier()
        return records, Action.CONTINUE

    @torch.no_grad()
    def _answer(self, ids: list[int]) -> list[int]:
        if self.greedy_token is not None:
            return self._answer_through_stages(ids)
        from transformers import DynamicCache

        model = self.model.module if self.alone else self.model
        device = self.env.device
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        cache = DynamicCache()
        tokens = torch.tensor([ids], dtype=torch.long, device=device)
        out: list[int] = []
        for _ in range(self.max_new_tokens):
            with autocast:
                logits = model(input_ids=tokens, use_cache=True, **{self.cache_argument: cache}).logits
            chosen = logits[:, -1].argmax(dim=-1)
            if not self.alone and self.env.world_size > 1:
                dist.broadcast(chosen, src=0)  # one token for every rank, whatever their last bits
            token = int(chosen.item())
            if token in self.stops:
                break
            out.append(token)
            tokens = chosen.reshape(1, 1)
        return out

    def _answer_through_stages(self, ids: list[int]) -> list[int]:
        assert self.greedy_token is not None
        device = self.env.device
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        tokens = torch.tensor([ids], dtype=torch.long, device=device)
        out: list[int] = []
        for _ in range(self.max_new_tokens):
            with autocast:
                token = self.greedy_token(tokens)
            if token in self.stops:
                break
            out.append(token)
            tokens = torch.cat([tokens, torch.tensor([[token]], dtype=torch.long, device=device)], dim=1)
        return out

    def _append(self, records: list[dict[str, Any]]) -> None:
        with open(self.samples_file, "a") as fh:
            for record in records:
                fh.write(json.dumps({"time": round(time.time(), 3), **record}, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
