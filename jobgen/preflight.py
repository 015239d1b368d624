"""Check a run against the live cluster before anything is queued.

Every problem is collected and reported together, each naming the spec key it
comes from, so a user fixes them all in one edit instead of one per submission.
The last check is ``sbatch --test-only`` on the exact script and options that
submit will use: if Slurm itself would refuse, we refuse first.

This module owns those checks and the kill window (``kill_window``); what a node state
means comes from the Slurm client's table (``jobgen.slurm.NODE_UNUSABLE``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jobgen import slurm
from jobgen.durations import format_human, parse_slurm_limit
from jobgen.goodput import KillWindow
from jobgen.resolved import ResolvedSpec

MIN_SLURM = (20, 11)


@dataclass(frozen=True)
class Finding:
    level: str  # "error", "warning" or "info"
    key: str  # spec key it concerns, "" for the cluster as a whole
    message: str

    def __str__(self) -> str:
        where = f"{self.key}: " if self.key else ""
        return f"{self.level}: {where}{self.message}"


def _gres_count(gres: str, name: str) -> int:
    """GPUs of gres ``name`` (``gpu`` or ``gpu:h100``) in a node's ``Gres=`` string,
    e.g. ``gpu:h100:8(S:0-1),shard:8``."""
    total = 0
    want = name.split(":")
    for item in gres.split(","):
        fields = item.split("(")[0].split(":")
        if not fields or fields[0] != want[0] or fields == ["(null)"]:
            continue
        if len(want) == 2 and (len(fields) < 3 or fields[1] != want[1]):
            continue
        try:
            total += int(fields[-1])
        except ValueError:
            continue
    return total


def check_cluster(spec: ResolvedSpec, quarantined: list[str] = ()) -> list[Finding]:
    """Partition, node count, time limit, CPUs and GPUs against what the cluster has, without
    the spec's excluded nodes and the run's ``quarantined`` ones."""
    findings: list[Finding] = []
    job, slurm_site = spec.run.job, spec.site.slurm
    ver = slurm.version()
    if ver[:2] < MIN_SLURM:
        findings.append(
            Finding("error", "", f"Slurm {'.'.join(map(str, ver))} is older than 20.11, which jobgen needs")
        )

    parts = {p.get("PartitionName", ""): p for p in slurm.partitions()}
    name = spec.partition or next((n for n, p in parts.items() if p.get("Default") == "YES"), None)
    key = "job.partition" if spec.run.job.partition else "site.slurm.partition"
    if name is None:
        findings.append(
            Finding("error", key, f"no partition given and the cluster has no default (it has: {', '.join(parts)})")
        )
        return findings
    part = parts.get(name)
    if part is None:
        findings.append(
            Finding("error", key, f"partition '{name}' does not exist (the cluster has: {', '.join(parts)})")
        )
        return findings
    if part.get("State", "UP") != "UP":
        findings.append(Finding("warning", key, f"partition '{name}' is {part.get('State')}: jobs will wait"))

    max_time = parse_slurm_limit(part.get("MaxTime", "UNLIMITED"))
    if max_time is not None and job.time > max_time:
        findings.append(
            Finding(
                "error",
                "job.time",
                f"{format_human(job.time)} exceeds partition '{name}' MaxTime {format_human(max_time)}",
            )
        )
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    if max_nodes.isdigit() and job.nodes > int(max_nodes):
        findings.append(
            Finding("error", "job.nodes", f"{job.nodes} nodes exceeds partition '{name}' MaxNodes {max_nodes}")
        )

    in_partition = set(slurm.hostnames(part.get("Nodes", "")))
    excluded = set(slurm.hostnames(",".join(job.exclude))) if job.exclude else set()
    excluded |= set(quarantined)
    wanted = set(slurm.hostnames(",".join(job.nodelist))) if job.nodelist else set()
    all_nodes = {n.get("NodeName", ""): n for n in slurm.nodes()}
    for node in sorted(wanted - in_partition):
        findings.append(Finding("error", "job.nodelist", f"node '{node}' is not in partition '{name}'"))
    candidates = [all_nodes[n] for n in sorted(in_partition - excluded) if n in all_nodes]
    if len(candidates) < job.nodes:
        findings.append(
            Finding(
                "error",
                "job.nodes",
                f"{job.nodes} nodes requested but partition '{name}' has {len(candidates)}"
                + (f" after excluding {', '.join(sorted(excluded & in_partition))}" if excluded & in_partition else ""),
            )
        )
        return findings

    fitting = [n for n in candidates if int(n.get("CPUTot", "0") or 0) >= slurm_site.cpus_per_node]
    if len(fitting) < job.nodes:
        most = max(int(n.get("CPUTot", "0") or 0) for n in candidates)
        findings.append(
            Finding(
                "error",
                "site.slurm.cpus_per_node",
                f"{slurm_site.cpus_per_node} CPUs per node requested; "
                f"only {len(fitting)} node(s) of partition '{name}' have that many (largest: {most})",
            )
        )
    if slurm_site.gpus_per_node:
        with_gpus = [
            n for n in candidates if _gres_count(n.get("Gres", ""), slurm_site.gres_name) >= slurm_site.gpus_per_node
        ]
        if len(with_gpus) < job.nodes:
            findings.append(
                Finding(
                    "error",
                    "site.slurm.gpus_per_node",
                    f"{slurm_site.gpus_per_node} x gres '{slurm_site.gres_name}' per node "
                    f"requested; {len(with_gpus)} node(s) of partition '{name}' have that",
                )
            )
    usable = [n for n in candidates if not (set(n.get("State", "").split("+")) & slurm.NODE_UNUSABLE)]
    if len(usable) < job.nodes:
        findings.append(
            Finding(
                "warning",
                "job.nodes",
                f"only {len(usable)} of {len(candidates)} nodes in '{name}' are up now; the job will wait for more",
            )
        )
    return findings


def kill_window(spec: ResolvedSpec, conf: dict[str, str] | None = None) -> KillWindow | None:
    """Slurm's SIGTERM-to-SIGKILL window for this run's partition, or None if Slurm does
    not say. Preemption counts only where the cluster preempts (PreemptType) and the
    partition does not exempt itself (PreemptMode=OFF). ``conf``: ``scontrol show config``
    when the caller has it already."""
    conf = conf if conf is not None else slurm.config()
    kill_wait = slurm.parse_seconds(conf.get("KillWait", ""))
    if kill_wait is None:
        return None
    parts = {p.get("PartitionName", ""): p for p in slurm.partitions()}
    part = parts.get(spec.partition or "") or next((p for p in parts.values() if p.get("Default") == "YES"), {})
    mode = part.get("PreemptMode", conf.get("PreemptMode", "OFF")).upper()
    preempts = conf.get("PreemptType", "preempt/none") != "preempt/none" and not mode.startswith("OFF")
    return KillWindow(kill_wait, slurm.parse_seconds(part.get("GraceTime", "0")) or 0, preempts)


def preflight(
    spec: ResolvedSpec, script: Path, sbatch_options: list[str], quarantined: list[str] = ()
) -> list[Finding]:
    """All cluster checks, then ``sbatch --test-only`` when the cluster checks passed."""
    findings = check_cluster(spec, quarantined)
    if not any(f.level == "error" for f in findings):
        try:
            estimate = slurm.sbatch_test_only(script, sbatch_options)
            findings.append(Finding("info", "", f"sbatch --test-only: {estimate.removeprefix('sbatch: ')}"))
        except slurm.SlurmError as exc:
            findings.append(Finding("error", "", f"sbatch --test-only refused the script: {exc.stderr}"))
    return findings


def pass_env_findings(spec: ResolvedSpec, environ: Mapping[str, str] | None = None) -> list[Finding]:
    """``job.pass_env``: every name must be set where the job is submitted from, since sbatch
    exports that environment to the job (and only it: jobgen never writes the values). A
    missing one is an error now rather than a job that fails at its first download."""
    environ = os.environ if environ is None else environ
    missing = [name for name in spec.run.job.pass_env if not environ.get(name)]
    if not missing:
        return []
    return [
        Finding(
            "error",
            "job.pass_env",
            f"{', '.join(missing)} not set in this shell: export it before submitting (the job gets it from here)",
        )
    ]


def memory_findings(spec: ResolvedSpec, *, ignore: bool = False) -> list[Finding]:
    """``jobgen plan``'s verdict as findings: an error (a warning with ``ignore``) when the run
    is predicted not to fit, naming the numbers and the changes that would make it fit; a
    warning when no estimate can be made (a hub id, a .bin checkpoint); an error, whatever
    ``ignore`` says, for malformed model files, on which training would fail too; otherwise an
    info line."""
    from jobgen.memory_plan import plan_run
    from jobgen.model_files import ModelFileError, UnsizedModel

    if spec.run.job.program != "train":
        return []
    try:
        plan = plan_run(spec)
    except ModelFileError as exc:
        return [Finding("error", "model.path", f"memory plan: {exc}")]
    except UnsizedModel as exc:  # from_pretrained may still load it (a .bin checkpoint)
        return [Finding("warning", "model.path", f"memory plan: cannot estimate: {exc}")]
    if plan.unavailable:
        return [Finding("warning", "model.path", plan.summary())]
    if plan.fits is not False:
        return [Finding("info", "", plan.summary())]
    lines = [plan.summary(), *plan.fit_advice("    ", " (`jobgen plan` shows the breakdown)")]
    if ignore:
        return [Finding("warning", "", "\n".join([*lines, "    submitting anyway (--ignore-memory-plan)"]))]
    lines.append("    --ignore-memory-plan submits anyway")
    return [Finding("error", "", "\n".join(lines))]
