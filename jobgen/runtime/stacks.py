"""Every rank's Python stack on this node, with py-spy: what a hang leaves for a person.

    srun --jobid=J --overlap --nodes=N --ntasks-per-node=1 python -m jobgen.runtime.stacks J

Run as a short overlapping step on each node of job J, by the batch script when no rank took
a step for train.hang_timeout (the job's supervisor, jobgen.job) and by the hang watchdog
(watchdogs.hang, through watchdogs.probe). It finds the job's training processes on this node
(torchrun workers carry ``RANK`` and ``LOCAL_RANK`` in their environment, and Slurm's
``SLURM_JOB_ID`` and ``SLURMD_NODENAME``) and prints a py-spy dump of each, with a header
naming node, rank and pid; it prints and exits 0 whatever it finds. py-spy reads a process's
memory without stopping it (``--nonblocking``), so a rank stopped by a signal or stuck in a
collective is dumped as it is.
"""

from __future__ import annotations

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


def process_state(pid: int) -> str:
    """The kernel's state letter of a process and its meaning ("T (stopped)": a SIGSTOP or a
    debugger; "D (disk sleep)": stuck in the kernel, often a filesystem), or "?"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    # The command name is in parentheses and may hold spaces: the state follows the last ')'.
    state = stat[stat.rfind(")") + 1 :].split()[:1]
    names = {"R": "running", "S": "sleeping", "D": "disk sleep", "T": "stopped", "t": "traced", "Z": "zombie"}
    return f"{state[0]} ({names.get(state[0], 'other')})" if state else "?"


def stacks(job_id: str) -> int:
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    procs = rank_processes(job_id, node)
    tool = py_spy()
    if not procs:
        print(f"=== node {node}: no training processes of job {job_id} found")
    for rank, local, pid in procs:
        print(f"=== node {node} rank {rank} (local {local}) pid {pid} state {process_state(pid)}", flush=True)
        if tool is None:
            print("py-spy not installed on this node (pip install py-spy)")
            continue
        # --nonblocking: never pause a rank that may be in the middle of a collective.
        try:
            proc = subprocess.run(
                [tool, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            print("py-spy did not answer within 60 s", flush=True)
            continue
        print(proc.stdout.rstrip() or f"py-spy exit {proc.returncode}: {proc.stderr.strip()}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdecimal():
        print("usage: python -m jobgen.runtime.stacks JOBID", file=sys.stderr)
        return 2
    return stacks(args[0])


if __name__ == "__main__":
    sys.exit(main())
