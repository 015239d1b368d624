"""``jobgen doctor``: submit the node health job and report which nodes are healthy.

    jobgen doctor --nodes 2

The job is the same rendered launch path as training (srun → torchrun → program),
so a doctor that passes means the network settings, the rendezvous and the Python
environment of the site profile work on those nodes.

This module owns submitting the doctor job, waiting for it and reporting its result.
The result is the ``doctor.json`` the doctor program (``trainer.doctor``) writes into
the run directory: the verdict and the table to print, then the site checks (what the site
profile asks of the nodes: the interface to the head node, the transport, the snapshot
tmpfs, the shared directories, the Python environment; each failing one with the profile
key that fixes it). The job's log is only shown, as it is, when that file is missing.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import click

from jobgen.base.durations import parse_duration
from jobgen.base.exit_codes import ExitCode
from jobgen.base.visible import visible
from jobgen.launch.submit import SubmitError, submit
from jobgen.runs import quarantine
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm
from jobgen.spec.loader import SpecError, read_toml, resolve

POLL_SECONDS = 2.0


def doctor_spec(
    *,
    nodes: int,
    procs_per_node: int | list[int] | None,
    site_ref: str | dict,
    partition: str | None,
    time_limit: str,
    nodelist: list[str] | None = None,
    base_dir: Path | None = None,
):
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    job: dict[str, object] = {
        "name": f"doctor-{stamp}",
        "program": "doctor",
        "nodes": nodes,
        "time": time_limit,
        "exit_grace": "30s",
    }
    if nodelist:
        job["nodelist"] = nodelist
    if procs_per_node is not None:
        job["procs_per_node"] = procs_per_node
    if partition:
        job["partition"] = partition
    base_dir = base_dir or Path.cwd()
    spec = resolve({"site": site_ref, "job": job}, spec_file=None, base_dir=base_dir)
    if procs_per_node is None and not spec.site.slurm.gpus_per_node:
        # A CPU site has no natural process count; two per node exercises intra-node traffic too.
        job["procs_per_node"] = min(2, spec.site.slurm.cpus_per_node)
        spec = resolve({"site": site_ref, "job": job}, spec_file=None, base_dir=base_dir)
    return spec


def wait_for(job_id: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while slurm.queue([job_id]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still queued or running after {timeout:.0f}s")
        time.sleep(POLL_SECONDS)


def report(run: RunDir, job_id: int) -> int:
    """Print the doctor's table from its ``doctor.json``; the exit code says whether every
    rank was healthy. Without that file, the last lines of the job's log say why."""
    verdict_file = run.path / "doctor.json"
    if not verdict_file.is_file():
        log = run.batch_log(run.path.name, job_id)
        text = log.read_text(errors="replace") if log.is_file() else ""
        click.echo(f"jobgen doctor: job {job_id} produced no report; last lines of {log}:", err=True)
        click.echo("\n".join(text.splitlines()[-25:]), err=True)
        return int(ExitCode.DOCTOR_FAILED)
    verdict = json.loads(verdict_file.read_text())
    if verdict.get("table"):
        click.echo("\n".join(["jobgen doctor:", *verdict["table"]]))
    site = site_table(verdict)
    if site:
        click.echo("\n".join(site))
    bad = bad_nodes(verdict)
    if bad:
        click.echo(
            f"jobgen doctor: to keep jobs off the failing nodes: --exclude={','.join(bad)}"
            f"  (in run.toml: [job] exclude = [{', '.join(json.dumps(n) for n in bad)}])"
        )
    site_ok = all(isinstance(c, dict) and c.get("ok") for c in verdict.get("site_checks") or [])
    return int(ExitCode.OK if verdict.get("ok") and site_ok else ExitCode.DOCTOR_FAILED)


SITE_HEADER = ("site check", "node(s)", "result", "found", "fix")


def site_table(verdict: dict) -> list[str]:
    """The site checks of a doctor verdict (its ``site_checks``: what the site profile asks of
    the nodes) as table lines: check, node(s), ok/FAIL, what was found, the fix naming the
    profile key. Nodes with the same result share a line; a verdict without site checks gives
    none, or one line saying why they were skipped."""
    checks = [c for c in verdict.get("site_checks") or [] if isinstance(c, dict)]
    if not checks:
        skipped = verdict.get("site_checks_skipped")
        return [f"site checks skipped: {visible(skipped)}"] if skipped else []
    everyone = sorted(map(str, verdict.get("nodes") or []))
    rows = [SITE_HEADER]
    for check in checks:
        nodes = [str(n) for n in check.get("nodes") or []]
        where = f"all {len(nodes)} nodes" if len(nodes) > 1 and sorted(nodes) == everyone else ",".join(nodes)
        cells = (check.get("check"), where, "ok" if check.get("ok") else "FAIL", check.get("found"), check.get("fix"))
        rows.append(tuple(visible(cell) if cell not in (None, "") else "-" for cell in cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(SITE_HEADER) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in rows]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def bad_nodes(verdict: dict) -> list[str]:
    """The nodes a doctor verdict finds at fault: a failed check, or versions that differ
    from the other nodes'."""
    if verdict.get("ok"):
        return []
    return sorted(set(verdict.get("failed_nodes") or {}) | set(verdict.get("version_mismatch") or {}))


def run_doctor(
    *,
    nodes: int,
    procs_per_node: int | list[int] | None,
    site_ref: str | dict,
    partition: str | None,
    time_limit: str,
    wait: bool,
    nodelist: list[str] | None = None,
    base_dir: Path | None = None,
) -> tuple[int, dict | None]:
    """Submit the doctor job; with ``wait``, print its report. Returns the exit code and the
    verdict (None when not waited for or when the job wrote none)."""
    try:
        spec = doctor_spec(
            nodes=nodes,
            procs_per_node=procs_per_node,
            site_ref=site_ref,
            partition=partition,
            time_limit=time_limit,
            nodelist=nodelist,
            base_dir=base_dir,
        )
        result = submit(spec)
    except SpecError as exc:
        click.echo("jobgen doctor: " + "\n  ".join(["invalid request:", *map(str, exc.issues)]), err=True)
        return 2, None
    except SubmitError as exc:
        click.echo("jobgen doctor: not submitted:\n  " + "\n  ".join(map(str, exc.findings)), err=True)
        return 2, None
    assert result.job_id is not None
    click.echo(f"submitted doctor job {result.job_id}: {spec.layout}, run dir {result.run_dir}")
    if not wait:
        return 0, None
    wait_for(result.job_id, timeout=parse_duration(time_limit) + 120)
    doctor_run = RunDir(result.run_dir)
    verdict_file = doctor_run.path / "doctor.json"
    code = report(doctor_run, result.job_id)
    return code, json.loads(verdict_file.read_text()) if verdict_file.is_file() else None


def _site_of(run: RunDir, spec) -> str | dict:
    """The run's site as its run.toml gave it (a profile, or a [site] table with overrides
    such as health_check), so the doctor checks the nodes as the run's tasks do."""
    try:
        site = read_toml(run.path / "run.toml").get("site")
    except SpecError:
        site = None
    return site if isinstance(site, (str, dict)) else spec.site_file or "local"


def clear_quarantine(run: RunDir, *, time_limit: str) -> int:
    """``jobgen doctor --clear RUN``: the health check on the nodes the run quarantined, with
    the run's site, partition and processes per node; those it passes on are released and
    the run's pending jobs may use them again. A node the check fails on, or a check that
    produced no report, keeps its quarantine."""
    held = sorted(quarantine.read(run))
    if not held:
        click.echo(f"jobgen doctor: run {run.path.name} has no quarantined nodes")
        return 0
    spec = run.load_spec()
    click.echo(f"jobgen doctor: checking the quarantined node(s) {', '.join(held)} of run {run.path.name}")
    code, verdict = run_doctor(
        nodes=len(held),
        # With unequal nodes (a list), which entry a quarantined node held is not recorded: each
        # is checked with the smallest, which every node of the run can give.
        procs_per_node=min(spec.node_procs),
        site_ref=_site_of(run, spec),
        partition=spec.partition,
        time_limit=time_limit,
        wait=True,
        nodelist=held,
        base_dir=Path(spec.spec_file).parent if spec.spec_file else None,
    )
    if verdict is None:
        click.echo("jobgen doctor: no report: every node stays quarantined", err=True)
        code = code or int(ExitCode.DOCTOR_FAILED)
    passed = [n for n in held if verdict is not None and n not in bad_nodes(verdict)]
    released = quarantine.release(run, passed)
    still = sorted(quarantine.read(run))
    updated = quarantine.exclude_from_pending(run, spec) if released else []
    if released:
        click.echo(
            f"jobgen doctor: released {', '.join(released)}"
            + (f"; pending job(s) {', '.join(updated)} may use them again" if updated else "")
        )
    if still:
        click.echo(f"jobgen doctor: still quarantined: {', '.join(still)}")
    return code
