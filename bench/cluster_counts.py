"""What the dev-cluster benchmarks (bench/pipeline_vs_fsdp.py, bench/expert_parallel_cpu.py)
read of a run while it trains: the nodes' veth byte counters at two steps, and the run's
useful tokens/s between them.

    per_step, rate = bytes_and_rate(run, (3, 10), lambda: sent_bytes(NODES), "bench-fsdp")
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from helpers import cancel_submitted, last_step, read_jsonl, wait_for
from jobgen.devcluster.netns import veth_name


def sent_bytes(nodes: tuple[str, ...]) -> int:
    """What the ``nodes`` sent to the bridge: the host side of each veth receives it."""
    return sum(int(Path(f"/sys/class/net/{veth_name(n)}/statistics/rx_bytes").read_text()) for n in nodes)


def bytes_and_rate(run: Path, steps: tuple[int, int], counter: Callable[[], int], name: str) -> tuple[float, float]:
    """(what ``counter`` grew by per step between ``steps``, the median useful tokens/s of the
    steps in between) of the submitted ``run``, which is waited for and cancelled at the end."""
    try:
        marks: dict[int, int] = {}
        deadline = time.monotonic() + 900
        while steps[1] not in marks:
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: step {steps[1]} not reached in 900 s")
            step, counted = last_step(run), counter()
            for wanted in steps:
                if step >= wanted and wanted not in marks:
                    marks[wanted] = counted
            time.sleep(0.05)
        wait_for(lambda: (run / "done").exists(), 300, f"{name} to finish")
    finally:
        cancel_submitted()
    rates = [r["tokens_per_s"] for r in read_jsonl(run / "metrics.jsonl") if steps[0] < r.get("step", 0) <= steps[1]]
    return (marks[steps[1]] - marks[steps[0]]) / (steps[1] - steps[0]), statistics.median(rates)
