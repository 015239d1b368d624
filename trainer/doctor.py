"""Node health check: every rank proves it can join the world, talk, and hold memory.

Launched on every node by the rendered ``doctor.sbatch`` (``jobgen doctor --nodes 2``)::

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d ... \\
        -m trainer.doctor --run-dir RUN_DIR --expected-world-size 4

or by hand on one machine::

    torchrun --standalone --nproc-per-node=2 -m trainer.doctor --run-dir /tmp/doctor --expected-world-size 2

Each rank initialises the process group (NCCL on GPU, Gloo on CPU), all-reduces,
passes a barrier, allocates and verifies memory and times a bandwidth all-reduce.
A failing check is recorded, not raised, so that rank 0 can still collect every
rank's report, print one table per node, name the nodes that failed or whose
versions differ, and write ``doctor.json`` into the run directory.

Then the site checks, where the run directory holds the spec.json jobgen wrote: whether
every node gives what the site profile asks of it (network.ifname routes to the head node,
the transport has its devices, the snapshot tmpfs is large enough, the shared directories
are one filesystem, the Python environment has the trainer's modules). Each node's local
rank 0 reads its node (trainer.site_facts), rank 0 judges and merges the results
(trainer.site_checks); a failed one fails the verdict and names the profile key to change.

``doctor.json`` is the structured result: the verdict (``ok``, failed nodes, version
differences, every rank's report), the printed table (``table``, one line each) and the
site checks (``site_checks``: check, nodes, ok, found, fix; ``site_checks_skipped`` says
why there are none). ``jobgen doctor`` and ``jobgen status`` read it, never the job's log.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from jobgen.base.atomic import write_json_atomic
from jobgen.base.exit_codes import ExitCode
from trainer.site_checks import NodeFacts, SitePlan, judge, merge
from trainer.site_facts import plan_site_checks, read_node, remove_probes

BANDWIDTH_MIB = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="where doctor.json is written")
    parser.add_argument(
        "--expected-world-size",
        type=int,
        required=True,
        help="the processes of every node summed (ResolvedSpec.world_size)",
    )
    parser.add_argument("--alloc-mib", type=int, default=256, help="memory each rank allocates and verifies")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for init and each collective")
    return parser.parse_args(argv)


def identity() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    return {
        "rank": int(os.environ.get("RANK", 0)),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "checks": {},
        "errors": {},
    }


def run_check(report: dict[str, Any], name: str, fn) -> None:
    """Record a check's result; a failure is data for the table, not a crash."""
    start = time.perf_counter()
    try:
        value = fn()
        report["checks"][name] = value if value is not None else "ok"
    except Exception as exc:  # noqa: BLE001 - every failure must reach the report
        report["checks"][name] = "FAILED"
        report["errors"][name] = f"{type(exc).__name__}: {exc}"
    report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 4)


def check_all_reduce(device: torch.device) -> str:
    world, rank = dist.get_world_size(), dist.get_rank()
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    if value.item() != expected:
        raise RuntimeError(f"sum of ranks is {value.item()}, expected {expected}")
    return "ok"


def check_memory(device: torch.device, mib: int) -> str:
    count = mib * 1024 * 1024 // 4
    block = torch.arange(count, dtype=torch.float32, device=device)
    block.mul_(2.0)
    # The sum of 2*i for i < n is n*(n-1); summed in float64 to keep it exact.
    total = block.to(torch.float64).sum().item()
    if total != float(count) * (count - 1):
        raise RuntimeError(f"checksum mismatch on a {mib} MiB block")
    del block
    return f"{mib} MiB"


def check_bandwidth(device: torch.device) -> float:
    """Bus bandwidth of a 16 MiB all-reduce in GB/s (nccl-tests' busbw definition)."""
    world = dist.get_world_size()
    buf = torch.ones(BANDWIDTH_MIB * 1024 * 1024 // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up: connections are set up lazily
    iters = 5
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / iters
    algbw = buf.numel() * 4 / elapsed / 1e9
    return round(algbw * 2 * (world - 1) / world, 3) if world > 1 else round(algbw, 3)


def summarise(
    reports: list[dict[str, Any]], expected_world: int, site_checks: list[dict[str, Any]] | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Per-node table lines and the verdict, from every rank's report and the merged site checks
    (a failed one fails the verdict)."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for rep in sorted(reports, key=lambda r: r["rank"]):
        by_node.setdefault(rep["node"], []).append(rep)
    reference = {
        key: max((r[key] for r in reports), key=lambda v: sum(r[key] == v for r in reports))
        for key in ("torch", "nccl", "python")
    }
    failed_nodes: dict[str, list[str]] = {}
    mismatched: dict[str, list[str]] = {}
    header = f"{'node':<12} {'ranks':<10} {'device':<22} {'torch':<16} {'nccl':<8} {'busbw GB/s':>10}  status"
    lines = [header, "-" * len(header)]
    for node, reps in by_node.items():
        problems = [f"rank {r['rank']} {name}: {err}" for r in reps for name, err in r["errors"].items()]
        diffs = sorted({f"{k} {r[k]} (others {reference[k]})" for r in reps for k in reference if r[k] != reference[k]})
        if problems:
            failed_nodes[node] = problems
        if diffs:
            mismatched[node] = diffs
        bw = [r["checks"].get("bandwidth") for r in reps if isinstance(r["checks"].get("bandwidth"), float)]
        status = "FAILED" if problems else ("VERSIONS DIFFER" if diffs else "OK")
        lines.append(
            f"{node:<12} {','.join(str(r['rank']) for r in reps):<10} {reps[0]['device'][:22]:<22} "
            f"{reps[0]['torch']:<16} {reps[0]['nccl'] or '-'!s:<8} "
            f"{(min(bw) if bw else float('nan')):>10.3f}  {status}"
        )
    ranks_ok = not failed_nodes and not mismatched and len(reports) == expected_world
    site_failed = list(dict.fromkeys(str(c["check"]) for c in site_checks or [] if not c["ok"]))
    for node, problems in failed_nodes.items():
        lines.extend(f"FAILED {node}: {p}" for p in problems)
    for node, diffs in mismatched.items():
        lines.extend(f"VERSIONS DIFFER {node}: {d}" for d in diffs)
    bad = sorted(set(failed_nodes) | set(mismatched))
    lines.append(result_line(len(reports), expected_world, len(by_node), bad, site_failed))
    verdict = {
        "ok": ranks_ok and not site_failed,
        "world_size": len(reports),
        "expected_world_size": expected_world,
        "nodes": sorted(by_node),
        "failed_nodes": failed_nodes,
        "version_mismatch": mismatched,
        "ranks": reports,
        "table": lines,  # what ``jobgen doctor`` prints, so it never reads the log
        # What the site profile asks of the nodes, one entry per check and result (trainer.site_checks.merge).
        "site_checks": site_checks or [],
    }
    return lines, verdict


def result_line(ranks: int, expected_world: int, nodes: int, bad: list[str], site_failed: list[str]) -> str:
    """The table's last line: every rank OK, or what failed (the bad nodes, the site checks)."""
    site = f"site checks failed: {', '.join(site_failed)}"
    if not bad and ranks == expected_world:
        everyone = f"all {ranks} ranks OK on {nodes} node(s)"
        return f"RESULT: FAILED: {site} ({everyone})" if site_failed else f"RESULT: {everyone}"
    ranks_words = f"{ranks}/{expected_world} ranks reported; bad nodes: {', '.join(bad) or 'none'}"
    return f"RESULT: FAILED ({ranks_words}{'; ' + site if site_failed else ''})"


# --------------------------------------------------------------------------- site checks
# What the site profile asks of every node: read on each node by its local rank 0
# (trainer.site_facts), gathered to rank 0 and judged there (trainer.site_checks).


def site_checks(run_dir: Path, report: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Every rank: the site checks (trainer.site_checks). Rank 0 gets the merged entries for
    doctor.json and why there were none (no spec.json); the other ranks (None, None)."""
    rank = dist.get_rank()
    box: list[Any] = [None]
    held: list[tuple[int, str]] = []
    if rank == 0:
        try:
            box[0], held = plan_site_checks(run_dir)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the broadcast below
            box[0] = SitePlan(skipped=f"site checks not planned: {type(exc).__name__}: {exc}")
    mine: NodeFacts | None = None
    everyone: list[Any] = [None] * dist.get_world_size()
    try:
        # Also the barrier between rank 0's writes and the nodes' reads of the probe files.
        dist.broadcast_object_list(box, src=0)
        plan: SitePlan = box[0]
        if plan.needs is None:
            return ([], plan.skipped) if rank == 0 else (None, None)
        if report["local_rank"] == 0:
            try:
                mine = read_node(plan, report["node"])
            except Exception as exc:  # noqa: BLE001 - the other ranks wait in the gather below
                mine = NodeFacts(node=report["node"], errors={"site checks": f"{type(exc).__name__}: {exc}"})
        dist.all_gather_object(everyone, mine)
    finally:
        remove_probes(held)  # every node has read them (or a collective failed)
    if rank != 0:
        return None, None
    return merge(judge(plan, [facts for facts in everyone if facts is not None])), None


def write_verdict(
    args: argparse.Namespace, gathered: list[dict[str, Any]], site: list[dict[str, Any]] | None, skipped: str | None
) -> bool:
    """Rank 0: the tables printed into the job's log and the verdict written to doctor.json;
    whether it is ok."""
    lines, verdict = summarise(gathered, args.expected_world_size, site)
    if skipped:
        verdict["site_checks_skipped"] = skipped
    try:  # the table jobgen doctor prints, in the log too; the doctor itself needs only torch
        from jobgen.launch.doctor import site_table

        site_lines = site_table(verdict)
    except ImportError as exc:
        site_lines = [f"site checks: in doctor.json (no table here: {exc})"]
    print("\n".join(["jobgen doctor:", *lines, *site_lines]), flush=True)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    verdict["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat()
    write_json_atomic(args.run_dir / "doctor.json", verdict)
    return bool(verdict["ok"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = identity()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(report["local_rank"])
    device = torch.device("cuda", report["local_rank"]) if cuda else torch.device("cpu")
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=dt.timedelta(seconds=args.timeout))
    try:
        world = dist.get_world_size()
        if world != args.expected_world_size:
            report["errors"]["world_size"] = f"world size {world}, expected {args.expected_world_size}"
        run_check(report, "all_reduce", lambda: check_all_reduce(device))
        run_check(report, "barrier", lambda: dist.barrier())
        run_check(report, "memory", lambda: check_memory(device, args.alloc_mib))
        run_check(report, "bandwidth", lambda: check_bandwidth(device))

        site, skipped = site_checks(args.run_dir, report)
        gathered: list[dict[str, Any]] | None = [None] * world if dist.get_rank() == 0 else None  # type: ignore[list-item]
        dist.gather_object(report, gathered, dst=0)
        verdict_box: list[Any] = [None]
        if dist.get_rank() == 0:
            assert gathered is not None
            ok = write_verdict(args, gathered, site, skipped)
            verdict_box[0] = (ok, world == args.expected_world_size)
        dist.broadcast_object_list(verdict_box, src=0)
        ok, right_size = verdict_box[0]
    finally:
        dist.destroy_process_group()
    if not right_size:
        return int(ExitCode.WORLD_SIZE_MISMATCH)
    return int(ExitCode.OK if ok else ExitCode.DOCTOR_FAILED)


if __name__ == "__main__":
    from trainer.distributed import exit_now

    # As the trainer: no interpreter finalization for gloo's threads to abort in after the verdict.
    exit_now(main())
