"""Host memory that goes back to the system when a tensor is freed.

glibc serves allocations below ``M_MMAP_THRESHOLD`` from its heaps and keeps what is freed
there for reuse; it raises that threshold each time a mapped chunk is freed, up to 32 MiB.
A trainer frees and reallocates tensors of a few KiB to tens of MiB every step (gradients,
optimizer temporaries, activations, all-gather buffers, checkpoint staging), so after a few
steps they all come from the heaps, which fragment and only grow. Measured on the 374M
Llama on CPU (``bench/memory_targets.py``): one Adafactor process peaked at 2.74 GiB, an FSDP
rank at 4.2-5.1 GiB (varying with thread timing) with a resident set that grew by 400 MiB
over the first steps. With a fixed threshold of 256 KiB: 2.31 GiB, and 3.7 GiB with a flat
resident set (1 MiB left the FSDP rank at 4.1-4.3 GiB: many activations are under a MiB).

A fixed threshold (which also stops glibc from moving it) serves every allocation of
256 KiB or more with its own mapping, returned to the system on free; small objects stay
on the heaps. The cost is a page fault per page of each new large tensor: CPU training
of that 374M model took about 20% longer per step. GPU training barely sees it: its large
buffers live on the device or in pinned memory that CUDA allocates itself. Where host
speed matters more than host memory, glibc's own tunable wins over this module:
``MALLOC_MMAP_THRESHOLD_=33554432`` in the job's environment restores the 32 MiB ceiling.

    from trainer.memory.host_allocator import return_large_frees_to_os
    return_large_frees_to_os()  # first thing in the trainer process

Which to use is ``train.host_allocator`` (:func:`choose`): "lean" is this module's setting,
"glibc" glibc's own, and "auto" (the default) lean where host memory is tight or the run is
on GPUs, glibc's where a CPU run has room to spare. Measured by bench/throughput_cpu.py's
model on this 2-core machine: 783 useful tokens/s lean, 987 with glibc's threshold (21 %
faster), for a peak resident set 9 % larger (2067 MiB against 1895).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path

log = logging.getLogger("trainer.memory.host_allocator")

# mallopt(3) parameter numbers from glibc's malloc.h.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 << 10
ENV_OVERRIDE = "MALLOC_MMAP_THRESHOLD_"


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def return_large_frees_to_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve allocations of ``threshold`` bytes or more by their own mappings, returned to the
    system when freed. Returns whether the setting was applied (False: not glibc, or the
    environment already chose a threshold)."""
    if os.environ.get(ENV_OVERRIDE):
        log.info("%s is set in the environment: glibc's threshold left as configured", ENV_OVERRIDE)
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1


# A CPU run whose predicted peak per process is at most this share of the host memory one
# process may use keeps glibc's faster allocator: its heap retention has room.
AUTO_LEAN_ABOVE = 0.5


def choose(setting: str, *, on_gpu: bool, predicted_peak: int | None, memory_per_process: int | None) -> str:
    """ "lean" or "glibc" for ``train.host_allocator`` = ``setting``; with "auto", lean on GPU
    runs (their steps hardly touch host memory, their loads do), and on CPU unless the
    plan's predicted per-process peak is known to fit in AUTO_LEAN_ABOVE of the memory."""
    if setting != "auto":
        return setting
    if on_gpu or predicted_peak is None or not memory_per_process:
        return "lean"
    return "glibc" if predicted_peak <= AUTO_LEAN_ABOVE * memory_per_process else "lean"


def host_memory_per_process(local_processes: int, budget: int | None) -> int:
    """Host memory one of ``local_processes`` may use: the node's (or the job's cgroup's limit,
    if lower) shared equally, and at most ``budget`` (the plan's, from slurm.mem) if given."""
    import psutil

    total = psutil.virtual_memory().total
    limit = cgroup_memory_limit()
    share = min(total, limit or total) // max(1, local_processes)
    return min(share, budget) if budget else share


def cgroup_memory_limit() -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors (v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``): what Slurm's cgroup plugin allows the job; None where
    there is none. An unlimited v1 group reads as a huge number, which the caller's min()
    against the node's memory absorbs."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    groups = []  # (the hierarchy's root, the file, this process's path in it)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            groups.append((Path("/sys/fs/cgroup"), "memory.max", path))
        elif "memory" in controllers.split(","):
            groups.append((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", path))
    limits = []
    for root, name, path in groups:
        here = root / path.lstrip("/")
        for directory in (here, *here.parents):
            try:
                value = (directory / name).read_text().strip()
            except OSError:
                value = ""
            if value.isdigit():
                limits.append(int(value))
            if directory == root:
                break
    return min(limits) if limits else None


def configure(spec) -> str:
    """Apply ``spec.run.train.host_allocator`` to this process; returns what was chosen and why,
    for the log. Called before anything large is allocated."""
    if os.environ.get(ENV_OVERRIDE):
        return f"{ENV_OVERRIDE} is set in the environment: glibc's threshold left as configured"
    setting = spec.run.train.host_allocator
    on_gpu = spec.site.slurm.computes_on_gpu
    peak = per_process = None
    if setting == "auto" and not on_gpu:
        from jobgen.plan.memory_plan import plan_run

        try:
            plan = plan_run(spec)
        except Exception as exc:  # noqa: BLE001 - no plan is no reason not to train: stay lean
            log.info("host allocator: no memory plan (%s: %s)", type(exc).__name__, exc)
        else:
            peak = plan.peak or None
            per_process = host_memory_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), plan.budget)
    chosen = choose(setting, on_gpu=on_gpu, predicted_peak=peak, memory_per_process=per_process)
    if chosen == "lean":
        return_large_frees_to_os()
    why = f" (predicted peak {peak >> 20} MiB of {per_process >> 20} MiB per process)" if peak and per_process else ""
    return f"host allocator: {chosen}, train.host_allocator = '{setting}'{why}"
