"""Process group set-up and the few collectives the trainer's control flow needs.

Launched under torchrun, so RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* come from the
environment. NCCL on GPU, Gloo on CPU; every collective times out after the spec's
``collective_timeout`` so a hung rank ends the job instead of holding it forever.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from jobgen.runs.heartbeat import Heartbeat
from jobgen.runtime.devices import rank_gpu


class WorldSizeError(RuntimeError):
    """torchrun formed a world of another size than the spec's (its processes summed over its nodes)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # Processes on this node (torchrun's LOCAL_WORLD_SIZE: job.procs_per_node, or this node's
    # entry of the list, in a batch script), which HSDP's shard groups default to.
    local_world_size: int = 1
    # The GPU Slurm gave this rank (its node's CUDA_VISIBLE_DEVICES entry for LOCAL_RANK), which
    # it computes on, or would where the site computes on the CPU; None without GPUs.
    gpu: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_seconds: int, expected_world_size: int | None, *, use_gpu: bool = True) -> DistEnv:
    """The process group, NCCL on this rank's GPU where there is one and ``use_gpu`` (the
    site's slurm.gpu_compute), else gloo on the CPU. Raises MissingGpu when Slurm gave this
    node fewer GPUs than its ranks."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = rank_gpu()
    if use_gpu and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"  # gloo for CPU-side collectives (async checkpoint staging)
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=dt.timedelta(seconds=timeout_seconds))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    env = DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, local_world_size, gpu)
    mark_progress()  # the rendezvous may have waited long for the other nodes
    if expected_world_size is not None and env.world_size != expected_world_size:
        raise WorldSizeError(
            f"world size is {env.world_size}, the spec asks for {expected_world_size} "
            "(job.procs_per_node over job.nodes)"
        )
    return env


# When this rank last got something done (its start, the process group, a step, a save).
# An error that reaches a rank after it went a whole collective timeout without progress
# is one that waited for a silent peer: jobgen.runs.quarantine blames that peer's node.
_last_progress = time.monotonic()
# This rank's heartbeat file, from its first step while the batch script watches for hangs
# (train.hang_timeout; jobgen.runs.heartbeat): every mark of progress is a beat.
_heartbeat: Heartbeat | None = None


def mark_progress(step: int | None = None) -> None:
    """This rank got something done (at ``step``, when a step)."""
    global _last_progress
    _last_progress = time.monotonic()
    if _heartbeat is not None:
        _heartbeat.beat(step)


def start_heartbeat(env: DistEnv) -> None:
    """Beat from now on, if the batch script watches this launch (else nothing). Called as
    training starts: loading and resuming, however long, are never taken for a hang."""
    global _heartbeat
    stop_heartbeat()
    _heartbeat = Heartbeat.from_env(env.rank)


def stop_heartbeat() -> None:
    """Training is over on this rank (what follows, a final save or export, is no step)."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.close()
    _heartbeat = None


def pause_heartbeat() -> None:
    """No heartbeat to judge until the next mark of progress: called as a save begins, since a
    checkpoint of a large model may take longer than the hang timeout (a save that hangs
    meets the collective timeout)."""
    if _heartbeat is not None:
        _heartbeat.pause()


def seconds_since_progress() -> float:
    return time.monotonic() - _last_progress


def gpu_free_bytes() -> int:
    """Free memory on this rank's GPU (the memory guard's train.min_gpu_free_mib)."""
    free, _total = torch.cuda.mem_get_info()
    return free


def cap_device_memory(env: DistEnv, limit_bytes: int) -> float | None:
    """Hold this rank's CUDA allocations to ``limit_bytes`` (the site's device_memory) when the
    GPU has more: the budget ``jobgen plan`` checked is then the one enforced, and a run planned
    for a 24 GiB card behaves as on one when tried on a larger GPU. Returns the fraction set."""
    if env.device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(env.device).total_memory
    if limit_bytes >= total:
        return None
    fraction = limit_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, env.device)
    return fraction


def reduce_max(env: DistEnv, values: list[int]) -> list[int]:
    """Element-wise max over ranks: how every rank takes the same branch on the same step."""
    tensor = torch.tensor(values, dtype=torch.int64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def reduce_sum(env: DistEnv, values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]


def reduce_sum_and_max(env: DistEnv, sums: list[float], maxes: list[tuple[int, int]]) -> tuple[list[float], list[int]]:
    """Element-wise sums of ``sums`` and maxima of ``maxes`` over ranks, in one all-reduce where
    two would each cost a round trip (every step pays it: 1.4 ms for a gloo all-reduce between
    2 processes of this machine). Each of ``maxes`` is (value, bound) with 0 <= value <= bound;
    it travels as a one-hot count over 0..bound, and the largest value any rank holds is the
    largest with a count. Counts are exact in float64 for any number of ranks."""
    flat = list(sums)
    for value, bound in maxes:
        if not 0 <= value <= bound:
            raise ValueError(f"reduce_sum_and_max: {value} is outside 0..{bound}")
        flat += [1.0 if v == value else 0.0 for v in range(bound + 1)]
    summed = reduce_sum(env, flat)
    result, at = [], len(sums)
    for _value, bound in maxes:
        counts = summed[at : at + bound + 1]
        result.append(max(v for v, count in enumerate(counts) if count > 0))
        at += bound + 1
    return summed[: len(sums)], result


def broadcast_object(env: DistEnv, value: object) -> object:
    # Object collectives pickle: what is unpickled here was pickled by this job's own ranks
    # (this process's siblings, started together by torchrun), never read from a file.
    box = [value if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(env: DistEnv, value: object) -> list[object]:
    """Every rank's ``value``, in rank order, on every rank."""
    out: list[object] = [None] * env.world_size
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int) -> None:
    """Leave without Python's finalization. Everything the run needs (checkpoints,
    metrics, the done marker) is written and fsynced by now, and the process group is
    destroyed; what finalization would add is only C++ static destructors, and one of
    them (a still-joinable std::thread) aborted a finished gloo worker with SIGABRT
    ("terminate called without an active exception") in 2 of 4 fresh-clone CI runs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
