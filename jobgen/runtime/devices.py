"""Which GPU a rank uses, as Slurm and torchrun hand them out: Slurm sets the node's
CUDA_VISIBLE_DEVICES for the one task jobgen starts there (the GPUs the job got on that
node), torchrun starts the node's ranks under it, and rank LOCAL_RANK takes the LOCAL_RANK-th
of them (``cuda:LOCAL_RANK``, as the bundled trainer, Hugging Face's Trainer and Accelerate
do). The list is left whole for every rank rather than cut to one entry each: a program that
picks ``cuda:LOCAL_RANK`` itself would find no such device in a one-entry list.

Where the site computes on the CPU (``slurm.gpu_compute = false``: the dev cluster's fake
GPUs), the same GPU is what the rank would have used: recorded, not used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# What Slurm leaves in CUDA_VISIBLE_DEVICES for a step without GPUs on a GPU node.
NO_DEVICES = frozenset({"", "NoDevFiles", "-1"})


class MissingGpu(RuntimeError):
    """This rank's local rank has no GPU among the node's: the node got fewer than its ranks."""


def node_gpus(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The GPUs Slurm gave this node's task (CUDA_VISIBLE_DEVICES), None where it set none."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() in NO_DEVICES:
        return None
    return [entry.strip() for entry in visible.split(",")]


def rank_gpu(environ: Mapping[str, str] | None = None) -> str | None:
    """The GPU this rank uses (or would use), as Slurm numbers it on the node: the LOCAL_RANK-th
    entry of the node's CUDA_VISIBLE_DEVICES. None where Slurm gave the node none."""
    env = os.environ if environ is None else environ
    gpus = node_gpus(env)
    if gpus is None:
        return None
    local = int(env.get("LOCAL_RANK") or 0)
    if local >= len(gpus):
        node = env.get("SLURMD_NODENAME") or "this node"
        raise MissingGpu(
            f"local rank {local} has no GPU on {node}: Slurm gave it {len(gpus)} "
            f"(CUDA_VISIBLE_DEVICES={','.join(gpus)}) for {env.get('LOCAL_WORLD_SIZE', '?')} processes"
        )
    return gpus[local]
