"""A hand-written PyTorch loop under jobgen's lifecycle (``[job] program = "command"``):
it saves and stops on the time limit's signal, a preemption, ``scancel --signal=USR1``
or the kill switch, and the next array task continues from its checkpoint.

    [job]
    program = "command"
    [command]
    script = "torch_loop.py"
    args = ["--steps", "5000"]

Launched by jobgen's batch script on every node as
``torchrun ... torch_loop.py --steps 5000``.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from jobgen import runtime


def newest_checkpoint(directory) -> str | None:
    names = sorted(p.name for p in directory.glob("step-*.pt")) if directory.is_dir() else []
    return str(directory / names[-1]) if names else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--step-seconds", type=float, default=0.2, help="stands in for real work")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    job = runtime.current()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # A directory listing decides for every rank: rank 0 looks, everyone loads the same file.
    box = [newest_checkpoint(job.checkpoint_dir) if job.is_main else None]
    dist.broadcast_object_list(box, src=0)
    start = 0
    if box[0]:
        state = torch.load(box[0])
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]

    with runtime.lifecycle(start_step=start, job=job) as life:
        for step in range(start, args.steps):
            batch = torch.randn(32, 16, generator=torch.Generator().manual_seed(step * 1000 + dist.get_rank()))
            loss = model(batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_seconds)
            action = life.step_done(step + 1, loss=loss.item())
            if action.saves:
                if job.is_main:  # write to a temporary name, fsync, rename: never a half checkpoint
                    path = job.checkpoint_dir / f"step-{step + 1:08d}.pt"
                    job.checkpoint_dir.mkdir(exist_ok=True)
                    tmp = path.with_suffix(".tmp")
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
                    with open(tmp, "wb") as fh:
                        torch.save(state, fh)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, path)
                dist.barrier()
                life.saved()
            if action.exits:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
