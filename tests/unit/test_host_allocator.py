"""The trainer's host allocator setting: a large tensor freed below a live small one goes
back to the system (glibc's dynamic threshold would keep it in the heap)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO

# Runs in a fresh interpreter: glibc's threshold is process-wide and moves as memory is freed.
PROBE = r"""
import ctypes, ctypes.util, sys
applied = False
if sys.argv[1] == "apply":  # "leave" imports nothing beyond ctypes: glibc as it comes
    from trainer.memory.host_allocator import return_large_frees_to_os
    applied = return_large_frees_to_os()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
MIB = 1 << 20
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 // MIB
# A 24 MiB block freed: glibc's dynamic threshold rises to 24 MiB, as after a few
# training steps; from then on, tensors under 24 MiB come from the heap.
big = libc.malloc(24 * MIB); ctypes.memset(big, 1, 24 * MIB); libc.free(big)
grads = [libc.malloc(8 * MIB) for _ in range(8)]
for g in grads:
    ctypes.memset(g, 1, 8 * MIB)
keep = libc.malloc(64 * 1024)  # a small live object above them (a Python object, a tensor header)
ctypes.memset(keep, 1, 64 * 1024)
before = rss()
for g in grads:
    libc.free(g)
print(applied, before - rss())
"""


def probe(mode: str, **env: str) -> tuple[bool, int]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}, "PYTHONPATH": str(REPO), **env},
        check=True,
    )
    applied, released = proc.stdout.split()
    return applied == "True", int(released)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_tensors_go_back_to_the_system():
    applied, released = probe("apply")
    assert applied
    assert released >= 60, f"only {released} MiB of 64 MiB freed went back to the system"
    # Without the setting glibc keeps them (the behaviour the module exists for).
    _, kept = probe("leave")
    assert kept < 8, kept


def test_a_threshold_set_in_the_environment_wins():
    applied, _ = probe("apply", MALLOC_MMAP_THRESHOLD_="131072")
    assert not applied


def test_auto_is_lean_unless_a_cpu_run_has_room_to_spare():
    from trainer.memory.host_allocator import choose

    gib = 1 << 30
    # A CPU run predicted to use a quarter of its share keeps glibc's faster allocator...
    assert choose("auto", on_gpu=False, predicted_peak=2 * gib, memory_per_process=8 * gib) == "glibc"
    # ... one predicted at over half of it, or with no prediction, gets the lean one.
    assert choose("auto", on_gpu=False, predicted_peak=5 * gib, memory_per_process=8 * gib) == "lean"
    assert choose("auto", on_gpu=False, predicted_peak=None, memory_per_process=8 * gib) == "lean"
    assert choose("auto", on_gpu=False, predicted_peak=2 * gib, memory_per_process=None) == "lean"
    # GPU runs hardly allocate host memory while stepping; their loads do.
    assert choose("auto", on_gpu=True, predicted_peak=1, memory_per_process=8 * gib) == "lean"
    # An explicit setting is taken as it is.
    assert choose("glibc", on_gpu=True, predicted_peak=None, memory_per_process=None) == "glibc"
    assert choose("lean", on_gpu=False, predicted_peak=1, memory_per_process=8 * gib) == "lean"


def test_memory_per_process_is_the_lowest_of_node_cgroup_and_budget(monkeypatch):
    from trainer.memory import host_allocator

    gib = 1 << 30
    monkeypatch.setattr(host_allocator, "cgroup_memory_limit", lambda: 12 * gib)
    total = __import__("psutil").virtual_memory().total
    assert host_allocator.host_memory_per_process(2, None) == min(total, 12 * gib) // 2
    assert host_allocator.host_memory_per_process(2, 1 * gib) == min(min(total, 12 * gib) // 2, 1 * gib)
