"""Whether a run fits its site, before anything is rendered: a node's processes against the
site's CPUs and GPUs per node, unequal GPU nodes (one --gpus request that Slurm splits over the
nodes by what each has), CPU offload on a site that computes on no GPU, and the batch and shard
groups of every world size a task may get (job.min_nodes to job.nodes). Each problem is a
(key, message) pair; the loader names the run file."""

from __future__ import annotations

from jobgen.model.parallelism import shard_size_problem
from jobgen.spec.global_batch import GlobalBatchError, grad_accum_for
from jobgen.spec.resolved import in_job_restarts
from jobgen.spec.tables.run import RunSpec
from jobgen.spec.tables.site import SiteProfile

Problem = tuple[str, str]  # (the key that fixes it, what is wrong)


def site_problems(run: RunSpec, site: SiteProfile) -> list[Problem]:
    """What of the run its site cannot give: processes against the CPUs and GPUs of a node,
    unequal GPU nodes that Slurm could split another way, and the batch and shard groups of
    every world size a task may get."""
    issues: list[Problem] = []
    gpus, cpus = site.slurm.gpus_per_node, site.slurm.cpus_per_node
    given = run.job.procs_per_node
    # A list is checked entry by entry: every node is asked for the same CPUs and GPUs.
    entries = [(f"[{i}]", n) for i, n in enumerate(given)] if isinstance(given, list) else [("", given)]
    for index, ppn in entries:
        if gpus and ppn is not None and ppn > gpus:
            message = f"{ppn} processes per node but the site has {gpus} GPUs per node"
            issues.append(("job.procs_per_node" + index, message))
        if ppn is not None and ppn > cpus:
            message = f"{ppn} processes per node but only {cpus} CPUs per node (site slurm.cpus_per_node)"
            issues.append(("job.procs_per_node" + index, message))
    if gpus and run.job.unequal_nodes:
        issues.extend(_unequal_gpu_nodes(run, site))
    restarts = in_job_restarts(run, site)
    if run.job.kind.trains and run.train.snapshot_every_steps and not restarts:
        message = (
            f"snapshots every {run.train.snapshot_every_steps} steps are read only by a relaunch inside the task, "
            "and this run relaunches none (job.in_job_restarts, the site's slurm.in_job_restarts): set "
            "job.in_job_restarts to 1 or more, or leave train.snapshot_every_steps at 0"
        )
        issues.append(("train.snapshot_every_steps", message))
    if run.job.spare_nodes and not restarts:  # job.in_job_restarts = 0 itself: JobSpec says so
        message = (
            f"{run.job.spare_nodes} spare node(s) are used by a relaunch inside the task, and this site relaunches "
            "none by default (slurm.in_job_restarts): set job.in_job_restarts to 1 or more"
        )
        issues.append(("job.spare_nodes", message))
    if run.job.kind.trains:
        issues.extend(_world_sizes(run, site))
    return issues


def _unequal_gpu_nodes(run: RunSpec, site: SiteProfile) -> list[Problem]:
    """Unequal nodes on a GPU site ask for one GPU per process in all (--gpus), which Slurm
    splits over the nodes by what each has: only nodes named in job.nodelist, with exactly
    their entry's GPUs, leave it one way to split them (preflight compares the counts)."""
    counts = run.job.node_procs(site.slurm.default_procs_per_node)
    issues: list[Problem] = []
    if not run.job.nodelist:  # the loader names them from slurm.node_shapes where it can (jobgen.spec.node_shapes)
        described = " (the site's slurm.node_shapes has no such nodes in that order)" if site.slurm.node_shapes else ""
        issues.append(
            (
                "job.nodelist",
                f"job.procs_per_node {list(counts)} on a GPU site needs the {len(counts)} nodes named (job.nodelist), "
                f"in the order of the entries: one request of {sum(counts)} GPUs (--gpus) is split by Slurm over "
                "whichever nodes it picks, and only nodes with exactly "
                f"{' and '.join(map(str, counts))} GPUs leave it one way to split them{described}",
            )
        )
    if site.slurm.gres_name.split(":")[0] != "gpu":
        issues.append(
            (
                "site.slurm.gres_name",
                f"job.procs_per_node {list(counts)} asks for GPUs with --gpus, which counts gres 'gpu' only, "
                f"not '{site.slurm.gres_name}'",
            )
        )
    return issues


def _world_sizes(run: RunSpec, site: SiteProfile) -> list[Problem]:
    """The batch and the shard groups for every world size a task may get (job.min_nodes to
    job.nodes): a task that would find out at its start wastes its queue wait."""
    train = run.train
    default_ppn = site.slurm.default_procs_per_node
    issues: list[Problem] = []
    if train.cpu_offload and not site.slurm.computes_on_gpu:
        issues.append(
            (
                "train.cpu_offload",
                f"site '{site.name}' has no GPUs to compute on (slurm.gpus_per_node, slurm.gpu_compute): on CPU the "
                "states are in host memory "
                "already, and FSDP's CPU offload would only add copies",
            )
        )
    for nodes in run.job.node_counts:
        world = run.job.world_size(default_ppn, nodes)
        try:
            grad_accum_for(train, world)
        except GlobalBatchError as exc:
            issues.append(("train.global_batch_size", f"on {nodes} node(s): {exc}"))
            break
        node_procs = run.job.node_procs(default_ppn, nodes)
        problem = shard_size_problem(train.parallelism, world, node_procs, train.shard_size)
        keyed = ("train.shard_size", problem) if problem else None
        keyed = keyed or train.world_problem(world)
        if keyed:
            issues.append((keyed[0], f"on {nodes} node(s): {keyed[1]}"))
            break
    return issues
