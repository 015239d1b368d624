"""Measured memory peaks of one rank, per phase of a job: what ``jobgen plan`` predicts.

Phases, each ended by the trainer calling :meth:`MemoryPeaks.end_phase`:

``load``
    from the process start to the model and optimizer built and the checkpoint loaded;
``first_step``
    the first optimizer step of this job (optimizer state is allocated here);
``steady``
    everything after it, ended at exit.

Host: the peak resident set size (``VmHWM``), reset between phases by writing ``5`` to
``/proc/self/clear_refs`` (Linux >= 4.0); where that is refused the figure is the peak since
the process started (``host_peak_since_start`` says so). GPU: ``torch.cuda.max_memory_allocated``
and ``max_memory_reserved`` of this rank's device, reset between phases. ``max_memory_allocated``
is the figure ``jobgen plan`` predicts; ``nvidia-smi`` shows it plus the allocator's cache
and the CUDA context.

    peaks = MemoryPeaks(env.device)
    ...; peaks.end_phase("load")
    ...; peaks.end_phase("first_step")
    ...; peaks.end_phase("steady")
    summary["memory_peaks"] = combine_ranks(all_gather_object(env, peaks.as_dict()))
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import torch

PHASES = ("load", "first_step", "steady")
MIB = 2**20


def host_peak_bytes() -> int:
    """This process's peak RSS since start or since the last reset."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def reset_host_peak() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class MemoryPeaks:
    """Per-phase memory peaks of this rank (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.peaks: dict[str, dict[str, float]] = {}
        # The load phase starts at process start: no reset here.
        self.resettable = True

    def end_phase(self, phase: str) -> dict[str, float]:
        """Record the peaks since the previous phase ended under ``phase``, then reset them.
        Ending a phase again keeps the larger figures (e.g. ``steady`` at several exits)."""
        record = {"host_rss_peak_mib": round(host_peak_bytes() / MIB, 1)}
        if self.cuda:
            record["gpu_max_allocated_mib"] = round(torch.cuda.max_memory_allocated(self.device) / MIB, 1)
            record["gpu_max_reserved_mib"] = round(torch.cuda.max_memory_reserved(self.device) / MIB, 1)
            torch.cuda.reset_peak_memory_stats(self.device)
        previous = self.peaks.get(phase, {})
        self.peaks[phase] = {k: max(v, previous.get(k, 0.0)) for k, v in record.items()}
        self.resettable = reset_host_peak() and self.resettable
        return self.peaks[phase]

    def as_dict(self) -> dict[str, Any]:
        """``{"load": {...}, "first_step": {...}, "steady": {...}, "host_peak_since_start": bool}``
        with the phases ended so far, in phase order."""
        out: dict[str, Any] = {p: dict(self.peaks[p]) for p in PHASES if p in self.peaks}
        out.update({p: dict(v) for p, v in self.peaks.items() if p not in PHASES})
        out["host_peak_since_start"] = not self.resettable
        return out


def combine_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's peaks, plus ``max_over_ranks`` (the largest figure of each phase and kind):
    what ``metrics.json`` holds as ``memory_peaks``."""
    if not per_rank:
        return {}
    out = dict(per_rank[0])
    highest: dict[str, dict[str, float]] = {}
    for peaks in per_rank:
        for phase, figures in peaks.items():
            if isinstance(figures, dict):
                slot = highest.setdefault(phase, {})
                for key, value in figures.items():
                    slot[key] = max(value, slot.get(key, 0.0))
    out["max_over_ranks"] = highest
    out["ranks"] = len(per_rank)
    return out
