"""What a watchdog runs *on* a training job's nodes, as a short overlapping step.

    srun --jobid=J --overlap --nodes=N --ntasks-per-node=1 python -m watchdogs.probe stacks J
    srun --jobid=J --overlap --nodes=N --ntasks-per-node=1 python -m watchdogs.probe memory

``stacks`` finds the job's training processes on this node (torchrun workers carry
``RANK`` and ``LOCAL_RANK`` in their environment, and Slurm's ``SLURM_JOB_ID`` and
``SLURMD_NODENAME``) and prints a py-spy dump of each, with a header naming node,
rank and pid. ``memory`` prints one JSON line of this node's memory. Both print
and exit 0 whatever they find: the watchdog decides.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def rank_processes(job_id: str, node: str) -> list[tuple[int, int, int]]:
    """(global rank, local rank, pid) of the job's workers on this node. The node name
    matters where several slurmd share one kernel (the dev cluster, some containers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        env = _environ(int(entry.name))
        if env.get("SLURM_JOB_ID") != job_id or "LOCAL_RANK" not in env or "RANK" not in env:
            continue
        if node and env.get("SLURMD_NODENAME", node) != node:
            continue
        try:
            found.append((int(env["RANK"]), int(env["LOCAL_RANK"]), int(entry.name)))
        except ValueError:
            continue
    return sorted(found)


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def stacks(job_id: str) -> int:
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    procs = rank_processes(job_id, node)
    tool = py_spy()
    if not procs:
        print(f"=== node {node}: no training processes of job {job_id} found")
    for rank, local, pid in procs:
        print(f"=== node {node} rank {rank} (local {local}) pid {pid}", flush=True)
        if tool is None:
            print("py-spy not installed on this node (pip install py-spy)")
            continue
        # --nonblocking: never pause a rank that may be in the middle of a collective.
        proc = subprocess.run(
            [tool, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=60
        )
        print(proc.stdout.rstrip() or f"py-spy exit {proc.returncode}: {proc.stderr.strip()}", flush=True)
    return 0


def memory() -> int:
    import psutil

    vm = psutil.virtual_memory()
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    print(
        json.dumps(
            {"node": node, "total_bytes": vm.total, "available_bytes": vm.available, "used_percent": vm.percent}
        ),
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["stacks"] and len(args) == 2:
        return stacks(args[1])
    if args == ["memory"]:
        return memory()
    print("usage: python -m watchdogs.probe stacks JOBID | memory", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
