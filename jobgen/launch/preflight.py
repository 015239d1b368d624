"""Check a run against the live cluster before anything is queued.

Every problem is collected and reported together, each naming the spec key it
comes from, so a user fixes them all in one edit instead of one per submission.
The last check is ``sbatch --test-only`` on the exact script and options that
submit will use: if Slurm itself would refuse, we refuse first.

This module owns those checks and the kill window (``kill_window``); what a node state
means comes from the Slurm client's table (``jobgen.slurm.client.NODE_UNUSABLE``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from jobgen.base.durations import format_human, parse_slurm_limit
from jobgen.runs.goodput import KillWindow
from jobgen.slurm import client as slurm
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.run import JobSpec
from jobgen.spec.tables.site import SlurmSettings

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


@dataclass(frozen=True)
class _ClusterFacts:
    """What Slurm says that the run's checks need. The node facts are gathered only once the
    run's partition is known (``partition`` is not None): they are the nodes of that partition."""

    version: tuple[int, ...]
    partitions: dict[str, dict[str, str]]  # by PartitionName
    name: str | None  # the run's partition: the spec's, else the cluster's default
    partition: dict[str, str] | None  # its record, None if there is no such partition
    max_time: int | None = None  # its MaxTime in seconds, None for UNLIMITED
    in_partition: frozenset[str] = frozenset()  # the partition's node names
    excluded: frozenset[str] = frozenset()  # the spec's exclude and the quarantined nodes
    wanted: frozenset[str] = frozenset()  # the spec's nodelist
    nodes: Mapping[str, dict[str, str]] = field(default_factory=dict)  # every node, by NodeName

    @property
    def candidates(self) -> list[dict[str, str]]:
        """The partition's nodes the run may get, by name."""
        return [self.nodes[n] for n in sorted(self.in_partition - self.excluded) if n in self.nodes]


def _gather_cluster_facts(spec: ResolvedSpec, quarantined: list[str]) -> _ClusterFacts:
    """Everything the checks need from Slurm, through the client's calls; nothing about the nodes
    when the run's partition cannot be resolved, since the checks stop there."""
    job = spec.run.job
    ver = slurm.version()
    parts = {p.get("PartitionName", ""): p for p in slurm.partitions()}
    name = spec.partition or next((n for n, p in parts.items() if p.get("Default") == "YES"), None)
    part = parts.get(name) if name is not None else None
    if part is None:
        return _ClusterFacts(ver, parts, name, None)
    # Parsed here, before the node queries: a MaxTime jobgen cannot read fails the check first.
    max_time = parse_slurm_limit(part.get("MaxTime", "UNLIMITED"))
    in_partition = set(slurm.hostnames(part.get("Nodes", "")))
    excluded = set(slurm.hostnames(",".join(job.exclude))) if job.exclude else set()
    excluded |= set(quarantined)
    wanted = set(slurm.hostnames(",".join(job.nodelist))) if job.nodelist else set()
    all_nodes = {n.get("NodeName", ""): n for n in slurm.nodes()}
    return _ClusterFacts(
        ver, parts, name, part, max_time, frozenset(in_partition), frozenset(excluded), frozenset(wanted), all_nodes
    )


def _version_findings(ver: tuple[int, ...]) -> list[Finding]:
    if ver[:2] < MIN_SLURM:
        return [Finding("error", "", f"Slurm {'.'.join(map(str, ver))} is older than 20.11, which jobgen needs")]
    return []


def _partition_findings(spec: ResolvedSpec, facts: _ClusterFacts) -> list[Finding]:
    """The partition exists (or the cluster has a default) and is up."""
    key = "job.partition" if spec.run.job.partition else "site.slurm.partition"
    name, part, parts = facts.name, facts.partition, facts.partitions
    if name is None:
        return [
            Finding("error", key, f"no partition given and the cluster has no default (it has: {', '.join(parts)})")
        ]
    if part is None:
        return [Finding("error", key, f"partition '{name}' does not exist (the cluster has: {', '.join(parts)})")]
    if part.get("State", "UP") != "UP":
        return [Finding("warning", key, f"partition '{name}' is {part.get('State')}: jobs will wait")]
    return []


def _limit_findings(job: JobSpec, name: str, part: dict[str, str], max_time: int | None) -> list[Finding]:
    """The partition's MaxTime and MaxNodes."""
    findings = []
    if max_time is not None and job.time > max_time:
        findings.append(
            Finding(
                "error",
                "job.time",
                f"{format_human(job.time)} exceeds partition '{name}' MaxTime {format_human(max_time)}",
            )
        )
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    if max_nodes.isdigit() and job.allocated_nodes > int(max_nodes):
        findings.append(Finding("error", "job.nodes", f"{_asked(job)} exceeds partition '{name}' MaxNodes {max_nodes}"))
    return findings


def _asked(job: JobSpec) -> str:
    """The nodes each task asks for, in words."""
    spares = f" (job.nodes {job.nodes} + job.spare_nodes {job.spare_nodes})" if job.spare_nodes else ""
    return f"{job.allocated_nodes} nodes{spares}"


def _nodelist_findings(name: str, facts: _ClusterFacts) -> list[Finding]:
    return [
        Finding("error", "job.nodelist", f"node '{node}' is not in partition '{name}'")
        for node in sorted(facts.wanted - facts.in_partition)
    ]


def _node_count_findings(job: JobSpec, name: str, facts: _ClusterFacts) -> list[Finding]:
    """Too few nodes left in the partition once the excluded ones are taken out (fewer than
    job.min_nodes, which a task may run on, when it is set)."""
    count = len(facts.candidates)
    fewest = job.min_nodes or job.allocated_nodes
    gone = facts.excluded & facts.in_partition
    excluding = f" after excluding {', '.join(sorted(gone))}" if gone else ""
    if count >= job.allocated_nodes:
        return []
    if count >= fewest:
        return [
            Finding(
                "info",
                "job.min_nodes",
                f"partition '{name}' has {count} of the {job.nodes} nodes{excluding}: tasks run on {count} "
                "until more are back",
            )
        ]
    asked = f"{_asked(job)} requested" if fewest == job.allocated_nodes else f"at least {fewest} nodes (job.min_nodes)"
    return [Finding("error", "job.nodes", f"{asked} but partition '{name}' has {count}{excluding}")]


def _node_resource_findings(
    job: JobSpec, slurm_site: SlurmSettings, gpus: int, name: str, candidates: list[dict[str, str]]
) -> list[Finding]:
    """Enough candidate nodes with the CPUs and ``gpus`` GPUs asked for, and up now."""
    findings = []
    fewest = job.min_nodes or job.allocated_nodes  # what a task can start on
    fitting = [n for n in candidates if int(n.get("CPUTot", "0") or 0) >= slurm_site.cpus_per_node]
    if len(fitting) < fewest:
        most = max(int(n.get("CPUTot", "0") or 0) for n in candidates)
        findings.append(
            Finding(
                "error",
                "site.slurm.cpus_per_node",
                f"{slurm_site.cpus_per_node} CPUs per node requested; "
                f"only {len(fitting)} node(s) of partition '{name}' have that many (largest: {most})",
            )
        )
    if gpus and not job.unequal_nodes:  # unequal nodes: _node_procs_findings
        with_gpus = [n for n in candidates if _gres_count(n.get("Gres", ""), slurm_site.gres_name) >= gpus]
        if len(with_gpus) < fewest:
            findings.append(
                Finding(
                    "error",
                    "site.slurm.gpus_per_node",
                    f"{gpus} x gres '{slurm_site.gres_name}' per node requested for "
                    f"{fewest} node(s); {len(with_gpus)} node(s) of partition '{name}' have that "
                    f"({_gpu_counts(candidates, slurm_site.gres_name)})",
                )
            )
    usable = [n for n in candidates if not (set(n.get("State", "").split("+")) & slurm.NODE_UNUSABLE)]
    if len(usable) < fewest:
        findings.append(
            Finding(
                "warning",
                "job.nodes",
                f"only {len(usable)} of {len(candidates)} nodes in '{name}' are up now; the job will wait for more",
            )
        )
    return findings


def _decide(spec: ResolvedSpec, facts: _ClusterFacts) -> list[Finding]:
    """The findings from what Slurm said; the checks stop at a missing partition and at too
    few nodes, since the ones after would only repeat them."""
    job = spec.run.job
    findings = _version_findings(facts.version) + _partition_findings(spec, facts)
    if facts.name is None or facts.partition is None:
        return findings
    findings += _limit_findings(job, facts.name, facts.partition, facts.max_time)
    findings += _nodelist_findings(facts.name, facts)
    shortfall = _node_count_findings(job, facts.name, facts)
    if any(f.level == "error" for f in shortfall):
        return findings + shortfall
    resources = _node_resource_findings(job, spec.site.slurm, spec.gpus_per_node, facts.name, facts.candidates)
    return findings + shortfall + resources + _node_procs_findings(spec, facts)


def _node_procs_findings(spec: ResolvedSpec, facts: _ClusterFacts) -> list[Finding]:
    """Unequal nodes (job.procs_per_node as a list): which node gets which entry. Entry N goes
    to node N of the allocation ($SLURM_NODEID), and Slurm orders an allocation's nodes as its
    configuration lists them (scontrol show nodes), whatever order job.nodelist names them in."""
    if not spec.run.job.unequal_nodes:
        return []
    counts = spec.node_procs
    if spec.site.slurm.gpus_per_node:
        return _unequal_gpu_findings(spec, facts)
    if len(facts.wanted) == len(counts):
        ordered = [name for name in facts.nodes if name in facts.wanted]
        pairs = ", ".join(f"{name} {count}" for name, count in zip(ordered, counts))
        return [Finding("info", "job.procs_per_node", f"processes per node, node by node: {pairs}")]
    return [
        Finding(
            "info",
            "job.procs_per_node",
            f"{' + '.join(map(str, counts))} processes, in the order of the nodes Slurm picks: "
            "set job.nodelist to the nodes meant for them",
        )
    ]


def _unequal_gpu_findings(spec: ResolvedSpec, facts: _ClusterFacts) -> list[Finding]:
    """Unequal nodes on a GPU site: one request of a GPU per process (--gpus), which Slurm
    splits over job.nodelist's nodes by what each has. Placed only where each node, in the
    allocation's order, has exactly its entry's GPUs: with more on a node, Slurm may split the
    request another way (3 + 1 asked of nodes with 4 and 2 may come as 2 + 2)."""
    counts, gres = spec.node_procs, spec.site.slurm.gres_name
    ordered = [name for name in facts.nodes if name in facts.wanted]
    has = {name: _gres_count(facts.nodes[name].get("Gres", ""), gres) for name in ordered}
    pairs = ", ".join(f"{name} {has[name]}" for name in ordered)
    if len(ordered) != len(counts) or any(has[name] != count for name, count in zip(ordered, counts)):
        return [
            Finding(
                "error",
                "job.procs_per_node",
                f"{' + '.join(map(str, counts))} processes cannot be placed one per GPU on job.nodelist "
                f"({pairs or 'no such nodes'}, gres '{gres}', in Slurm's order): each node needs exactly its "
                "entry's GPUs, or Slurm may split the job's --gpus another way",
            )
        ]
    return [Finding("info", "job.procs_per_node", f"processes and GPUs per node, node by node: {pairs}")]


def _gpu_counts(nodes: list[dict[str, str]], gres: str) -> str:
    """``node1 3, node2 1``: each node's GPUs of gres ``gres``."""
    return ", ".join(f"{n.get('NodeName', '?')} {_gres_count(n.get('Gres', ''), gres)}" for n in nodes) or "no nodes"


def check_cluster(spec: ResolvedSpec, quarantined: list[str] = ()) -> list[Finding]:
    """Partition, node count, time limit, CPUs and GPUs against what the cluster has, without
    the spec's excluded nodes and the run's ``quarantined`` ones."""
    return _decide(spec, _gather_cluster_facts(spec, quarantined))


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
    warning when it fits tightly (over 90 % of the budget) or no estimate can be made (a hub
    id, a .bin checkpoint); an error, whatever
    ``ignore`` says, for malformed model files, on which training would fail too; otherwise an
    info line."""
    from jobgen.model.files import ModelFileError, UnsizedModel
    from jobgen.plan.memory_plan import plan_run

    if not spec.run.job.kind.trains:
        return []
    try:
        plan = plan_run(spec)
    except ModelFileError as exc:
        return [Finding("error", "model.path", f"memory plan: {exc}")]
    except UnsizedModel as exc:  # from_pretrained may still load it (a .bin checkpoint)
        return [Finding("warning", "model.path", f"memory plan: cannot estimate: {exc}")]
    if plan.unavailable:
        return [Finding("warning", "model.path", plan.summary())]
    if plan.tight:
        # Over 90 % of the budget: it may run, so it is queued, with the changes that leave room.
        advice = plan.fit_advice("    ", " (`jobgen plan` shows the breakdown)")
        return [Finding("warning", "", "\n".join([plan.summary(), *advice]))]
    if plan.fits is not False:
        return [Finding("info", "", plan.summary())]
    lines = [plan.summary(), *plan.fit_advice("    ", " (`jobgen plan` shows the breakdown)")]
    if ignore:
        return [Finding("warning", "", "\n".join([*lines, "    submitting anyway (--ignore-memory-plan)"]))]
    lines.append("    --ignore-memory-plan submits anyway")
    return [Finding("error", "", "\n".join(lines))]


def command_findings(spec: ResolvedSpec) -> list[Finding]:
    """What a ``program = "command"`` run gets at a time limit or a preemption, in plain words
    for ``validate`` and ``submit``: a warning where each stop loses work, with what saves it."""
    command = spec.run.command
    if command is None:  # [command] is there exactly when the program is your own (RunSpec)
        return []
    if command.hf_trainer:
        return [
            Finding(
                "info",
                "command.hf_trainer",
                "at a time limit or preemption your Trainer saves a checkpoint when the signal arrives and "
                "stops; the next task resumes from it and redoes no step",
            )
        ]
    if command.stop_signal == "none":
        return [
            Finding(
                "info",
                "command.stop_signal",
                "'none': no signal is forwarded to your program; it must read jobgen's stop request itself "
                "(jobgen.runtime) and save, or Slurm kills it at the time limit",
            )
        ]
    signal = f"SIG{command.stop_signal}"
    if command.resume_args:
        return [
            Finding(
                "warning",
                "command.resume_args",
                f"at a time limit the batch shell forwards {signal} to your program, which stops without "
                "saving: each limit loses the steps since its own last save (up to its save interval), and the "
                f"next task resumes from {{latest_checkpoint}} ('{command.checkpoints}' in {spec.run_dir}/"
                "checkpoints). To save at the signal instead: hf_trainer = true (a Hugging Face Trainer), or "
                "jobgen.runtime in the program with stop_signal = 'none' (docs/own-program.md)",
            )
        ]
    return [
        Finding(
            "warning",
            "command",
            f"at a time limit the batch shell forwards {signal} to your program: no save is asked for and "
            "nothing resumes it, so each array task starts over. Set hf_trainer = true (a Hugging Face "
            "Trainer), resume_args = [..., '{latest_checkpoint}'] (a program that saves on its own), or use "
            "jobgen.runtime in the program and stop_signal = 'none' (docs/own-program.md)",
        )
    ]
