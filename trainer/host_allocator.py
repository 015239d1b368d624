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

    from trainer.host_allocator import return_large_frees_to_os
    return_large_frees_to_os()  # first thing in the trainer process
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("trainer.host_allocator")

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
