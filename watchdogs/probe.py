"""What a watchdog runs *on* a training job's nodes, as a short overlapping step.

    srun --jobid=J --overlap --nodes=N --ntasks-per-node=1 python -m watchdogs.probe stacks J
    srun --jobid=J --overlap --nodes=N --ntasks-per-node=1 python -m watchdogs.probe memory

``stacks`` is jobgen.runtime.stacks (the batch script takes the same dump when it finds a
launch hung). ``memory`` prints one JSON line of this node's memory. Both print and exit 0
whatever they find: the watchdog decides.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from jobgen.runtime.stacks import stacks


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
