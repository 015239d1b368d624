"""Checkpoint cost: how long training is blocked per save, sync and async, against the
checkpoint's size and the disk's sequential write bandwidth measured in the same run.

The trainer's own :class:`trainer.checkpoints.checkpointer.Checkpointer` saves a model with its AdamW
state (a world of one gloo process, as a one-process trainer run has), into a directory on
the disk under test. The limit is the disk: writing the checkpoint's bytes sequentially to
one file and fsyncing it, as fast as Python can. Figures:

- sync: seconds blocked per save (= the whole save) and the write rate it reaches, as a
  fraction of the measured bandwidth (target: at least 70 %);
- async: seconds blocked per save (the staging copy), as a fraction of a sync save's
  (target: at most 10 %); the save's total time; and how much slower the training steps
  taken while it writes in the background are than steps without a save.

On the machine that runs training, with the checkpoint directory on the disk in question
(about 4 minutes for the default 200M-parameter model, 2.4 GB per checkpoint; 8 GiB free
memory):

    .venv/bin/python bench/checkpoint_cost.py --dir /path/on/that/disk [--repeats 3]

Prints a table and writes ``DIR/checkpoint_cost.json``. ``--small`` checks the script
itself in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1e6
CHUNK = 64 * 2**20


def disk_bandwidth(directory: Path, nbytes: int) -> float:
    """Bytes/s of writing ``nbytes`` to one new file in 64 MiB chunks and fsyncing it."""
    path = directory / "bandwidth.probe"
    block = os.urandom(CHUNK)
    started = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(block[: min(CHUNK, nbytes - written)])
        os.fsync(f.fileno())
    seconds = time.monotonic() - started
    path.unlink()
    return nbytes / seconds


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the disk under test")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 10M model: checks the script only")
    args = parser.parse_args()

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.checkpoints.checkpointer import Checkpointer
    from trainer.distributed import init_distributed, shutdown

    shape = (
        dict(hidden_size=256, num_hidden_layers=2, intermediate_size=704, num_attention_heads=4)
        if args.small
        else dict(hidden_size=1024, num_hidden_layers=12, intermediate_size=2816, num_attention_heads=16)
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, 32000, (1, 128))

    def step() -> float:
        started = time.monotonic()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.monotonic() - started

    step()  # the optimizer's moments exist from here on, as in any checkpoint after step 1
    params = sum(p.numel() for p in model.parameters())
    env = init_distributed(600, 1)
    work = args.dir / "checkpoint_cost"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results: dict = {
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        "dir": str(args.dir.resolve()),
        "parameters": params,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        plain_steps = [step() for _ in range(3)]
        sync = Checkpointer(work / "sync", env, keep=1, every_steps=0, every_seconds=0, async_save=False)
        for i in range(args.repeats):
            sync.save(i + 1, model, optimizer, {"step": i + 1})
        size = tree_bytes(work / "sync" / sorted(p.name for p in (work / "sync").glob("step-*"))[-1])
        bandwidths = [disk_bandwidth(work, size) for _ in range(2)]

        background = Checkpointer(work / "async", env, keep=1, every_steps=0, every_seconds=0, async_save=True)
        steps_while_writing: list[float] = []
        for i in range(args.repeats):
            background.save(i + 1, model, optimizer, {"step": i + 1})
            while background._pending is not None and not background._pending.future.done():
                steps_while_writing.append(step())
            background.wait()
        bandwidths.append(disk_bandwidth(work, size))
    finally:
        shutdown()
        shutil.rmtree(work, ignore_errors=True)

    bandwidth = statistics.median(bandwidths)
    sync_s = statistics.median(sync.blocking_seconds)
    async_block = statistics.median(background.blocking_seconds)
    async_total = statistics.median(background.save_seconds)
    results.update(
        checkpoint_bytes=size,
        disk_bandwidth_mb_s=[round(b / MB) for b in bandwidths],
        sync_blocking_s=[round(s, 3) for s in sync.blocking_seconds],
        sync_rate_mb_s=round(size / sync_s / MB),
        sync_rate_of_bandwidth=round(size / sync_s / bandwidth, 3),
        async_blocking_s=[round(s, 3) for s in background.blocking_seconds],
        async_total_s=[round(s, 3) for s in background.save_seconds],
        async_blocking_of_sync=round(async_block / sync_s, 3),
        step_s=round(statistics.median(plain_steps), 3),
        step_while_writing_s=round(statistics.median(steps_while_writing), 3) if steps_while_writing else None,
    )
    (args.dir / "checkpoint_cost.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{results['machine']}; {params / 1e6:.0f}M parameters + AdamW: {size / MB:.0f} MB per checkpoint")
    print(f"disk, sequential write + fsync       {bandwidth / MB:8.0f} MB/s  (runs: {results['disk_bandwidth_mb_s']})")
    print(
        f"sync save, blocked                   {sync_s:8.2f} s     {results['sync_rate_mb_s']} MB/s = "
        f"{results['sync_rate_of_bandwidth']:.0%} of the disk (target >= 70%)"
    )
    print(
        f"async save, blocked                  {async_block:8.2f} s     "
        f"{results['async_blocking_of_sync']:.0%} of a sync save (target <= 10%)"
    )
    print(f"async save, until complete           {async_total:8.2f} s")
    if steps_while_writing:
        alone, writing = results["step_s"], results["step_while_writing_s"]
        print(
            f"training step: alone / while writing {alone:8.2f} s / {writing:.2f} s"
            f"  ({len(steps_while_writing)} steps taken during {args.repeats} background saves)"
        )


if __name__ == "__main__":
    main()
