"""Memory check: host memory of every node a RUNNING job of the run is on.

    python -m watchdogs.memory --run RUN [--max-percent 90]
    jobgen watchdog run memory RUN

Asks each node through a short ``srun --jobid --overlap`` step (``watchdogs.probe
memory``). When no step can be started (a cluster that forbids overlapping steps,
a controller that is slow to answer) it falls back on the trainer's own metrics,
which carry rank 0's node memory, and says so.
"""

from __future__ import annotations

import json
import sys

from jobgen.runs.summary_cache import summarize
from jobgen.slurm import client as slurm
from watchdogs.base import main as check_main
from watchdogs.base import running_jobs
from watchdogs.target import CheckResult, Target


def node_memory(job_id: int, nodes: int) -> list[dict]:
    proc = slurm.run_in_job(job_id, nodes, [sys.executable, "-m", "watchdogs.probe", "memory"])
    if proc.returncode != 0:
        raise slurm.SlurmError(["srun", f"--jobid={job_id}"], proc.returncode, proc.stderr)
    out = []
    for line in proc.stdout.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def from_metrics(target: Target, job_id: int) -> list[dict]:
    """Rank 0's node memory from the job's newest training line, read from the summary of
    metrics.jsonl (jobgen.runs.summary_cache), never its whole history."""
    newest = summarize(target.run.metrics).last_training_line_of_job(job_id)
    if newest is None or not newest[1]:
        return []
    return [{"node": "rank 0's node (from metrics.jsonl)", "used_percent": newest[0]}]


def check(target: Target) -> CheckResult:
    assert target.run is not None
    limit = target.settings.memory.max_percent
    jobs = running_jobs(target.run)
    if not jobs:
        return CheckResult("memory", target.name, False, "no job running")
    high, details, data = [], [], {"nodes": []}
    for job in jobs:
        try:
            nodes = node_memory(job.job_id, len(job.nodes) or 1)
        except (slurm.SlurmError, OSError) as exc:
            nodes = from_metrics(target, job.job_id)
            details.append(
                f"job {job.job_id}: srun step failed ({str(exc).splitlines()[-1][:200]}); "
                f"{'using the trainer metrics' if nodes else 'no metrics either'}"
            )
        for node in nodes:
            data["nodes"].append({"job_id": job.job_id, **node})
            line = f"{node['node']}: {node['used_percent']:.1f}% used"
            if "available_bytes" in node:
                line += (
                    f", {node['available_bytes'] / 2**30:.1f} GiB available of {node['total_bytes'] / 2**30:.1f} GiB"
                )
            (high if node["used_percent"] > limit else details).append(f"job {job.job_id} {line}")
    if high:
        return CheckResult(
            "memory", target.name, True, f"{high[0]} (above max_percent {limit:g}%)", high[1:] + details, data
        )
    if not data["nodes"]:
        return CheckResult("memory", target.name, True, "could not read the memory of any node", details, data)
    return CheckResult("memory", target.name, False, f"{len(data['nodes'])} node(s) below {limit:g}%", details, data)


def main(argv: list[str] | None = None) -> int:
    return check_main("memory", check, "Host memory of the run's nodes.", argv)


if __name__ == "__main__":
    sys.exit(main())
