"""``jobgen cluster up|down|status``: the click group the main CLI registers.

    jobgen cluster up --nodes 2 --cpus-per-node 4 [--netns] [--gpus 3,1] [--state-dir DIR]
    jobgen cluster status [--json]
    jobgen cluster down

Also runnable on its own: ``python -m jobgen.devcluster.cli up --nodes 2``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from . import instances, nodelocal, slurm_builds
from .config import DEBUG_MAX_TIME, DEFAULT_PARTITION, SHORT_MAX_TIME
from .lifecycle import DEFAULT_TIMEOUT, status, up
from .state import STATE_DIR_ENV, ClusterError, ClusterInfo
from .teardown import down

_state_dir_option = click.option(
    "--state-dir",
    envvar=STATE_DIR_ENV,
    default=None,
    show_envvar=True,
    help="Directory holding the cluster's config, logs and state [default: /var/tmp/jobgen-cluster].",
)


@click.group(name="cluster")
def cluster() -> None:
    """A real local Slurm cluster (munge, slurmctld, N slurmd, slurmdbd on MariaDB) for demos and tests."""


@cluster.command(name="up")
@click.option("--nodes", "-N", type=click.IntRange(1, 64), default=2, show_default=True, help="Number of slurmd nodes.")
@click.option("--cpus-per-node", type=click.IntRange(1), default=4, show_default=True, help="CPUs each node declares.")
@click.option(
    "--mem-per-node",
    "mem_per_node_mb",
    type=click.IntRange(64),
    default=4096,
    show_default=True,
    help="RealMemory (MB) each node declares; memory is not a consumable.",
)
@click.option(
    "--gpus",
    metavar="N[,N...]",
    callback=lambda _ctx, _param, value: _gpu_counts(value),
    help="Fake GPUs (GRES gpu) per node: one count for every node (2) or one per node (3,1).",
)
@click.option(
    "--netns/--no-netns",
    default=False,
    show_default=True,
    help="Give every node its own network namespace and eth0 address.",
)
@click.option(
    "--slurm",
    type=click.Choice(slurm_builds.SERIES),
    default=slurm_builds.SYSTEM_SERIES,
    show_default=True,
    help="Which Slurm: 22.05 is this machine's packages (Debian bookworm's); a newer series is built once "
    f"from Debian's source into ${slurm_builds.CACHE_ENV} (default {slurm_builds.DEFAULT_CACHE}) and reused.",
)
@click.option(
    "--timeout",
    type=float,
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds to wait for every node to become idle.",
)
@_state_dir_option
def up_cmd(
    nodes: int,
    cpus_per_node: int,
    mem_per_node_mb: int,
    gpus: list[int] | None,
    netns: bool,
    slurm: str,
    timeout: float,
    state_dir: str | None,
) -> None:
    """Start the cluster (installing slurm-wlm, munge, slurmdbd and mariadb-server if missing); idempotent."""
    shape = {"nodes": nodes, "cpus_per_node": cpus_per_node, "mem_per_node_mb": mem_per_node_mb, "netns": netns}
    try:
        info = up(**shape, state_dir=state_dir, timeout=timeout, gpus=gpus, slurm=slurm)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from None
    _print_status(info)


def _gpu_counts(value: str | None) -> list[int] | None:
    """--gpus 3,1 as counts; click names the option when it is no list of numbers."""
    try:
        return [int(n) for n in value.split(",")] if value else None
    except ValueError:
        raise click.BadParameter(f"{value!r}: GPU counts separated by commas (2, or 3,1)") from None


@cluster.command(name="down")
@_state_dir_option
@click.option("--all", "every", is_flag=True, help="Every dev cluster of this machine (CI's clean-up).")
def down_cmd(state_dir: str | None, every: bool) -> None:
    """Stop the cluster and remove everything `up` created; fine when nothing is up."""
    try:
        if not every:
            down(state_dir=state_dir)
        # A list, not a generator: every cluster is taken down, not just up to the first one up.
        elif not any([down(state_dir=one, quiet=True) for one in [None, *instances.registered()]]):
            click.echo("[jobgen cluster] no dev cluster is up on this machine; nothing to do", err=True)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from None


@cluster.command(name="status")
@click.option("--json", "as_json", is_flag=True, help="Print the cluster info as one JSON object.")
@_state_dir_option
def status_cmd(as_json: bool, state_dir: str | None) -> None:
    """Print nodes, their Slurm states, mode and state dir; exit 1 when not up."""
    try:
        info = status(state_dir=state_dir)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from None
    if info is None:
        if as_json:
            click.echo(json.dumps({"up": False}))
        else:
            click.echo("dev cluster: not up", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps({"up": True, **info.to_dict()}, indent=2, sort_keys=True))
    else:
        _print_status(info)


def _print_status(info: ClusterInfo) -> None:
    mode = f"netns (bridge {info.bridge}, controller {info.controller_addr})" if info.netns else "loopback"
    click.echo(f"dev cluster: up, {len(info.nodes)} nodes, {mode}, nic {info.nic}")
    click.echo(f"state dir:   {info.state_dir}")
    click.echo(f"slurm.conf:  {info.slurm_conf}")
    click.echo(f"slurm:       {info.slurm} ({info.slurm_prefix or 'the packages of this machine'})")
    if not _is_system_conf(info.slurm_conf):  # another dev cluster owns /etc/slurm/slurm.conf
        click.echo(f"reach it:    export SLURM_CONF={info.slurm_conf}  (dev cluster {info.instance} of this machine)")
    if info.slurm_prefix:  # its clients only: another release's cannot talk to its controller
        click.echo(f"clients:     export PATH={info.slurm_prefix}/bin:$PATH")
    click.echo(
        f"partitions:  {DEFAULT_PARTITION} (default, MaxTime {DEBUG_MAX_TIME}), short (MaxTime {SHORT_MAX_TIME})"
    )
    click.echo(f"node-local:  {nodelocal.describe(info)}")
    _print_daemons(info)
    rows = [("NODE", "ADDR", "PORT", "CPUS", "GPUS", "STATE", "SLURMD")]
    for node in info.nodes:
        pid = info.daemons.get(f"slurmd:{node}")
        rows.append(
            (
                node,
                info.node_addrs.get(node, "?"),
                str(info.slurmd_ports.get(node, "?")),
                str(info.cpus_per_node),
                str(info.gpus.get(node, 0)),
                info.node_states.get(node, "?"),
                f"pid {pid}" if pid else "not running",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _is_system_conf(slurm_conf: str) -> bool:
    link = Path("/etc/slurm/slurm.conf")
    return link.is_symlink() and Path(os.readlink(link)) == Path(slurm_conf)


def _print_daemons(info: ClusterInfo) -> None:
    """The controller and the accounting daemons, where they listen and whether they run."""
    daemons = [("slurmctld", f"{info.controller_addr}:{info.slurmctld_port}")]
    if info.slurmdbd_port:  # a record from before accounting has neither
        daemons.append(("slurmdbd", f"{info.controller_addr}:{info.slurmdbd_port}"))
        daemons.append(("mariadb", f"127.0.0.1:{info.mariadb_port}"))
    for name, addr in daemons:
        pid = info.daemons.get(name)
        click.echo(f"{name + ':':<12} {addr}, {f'pid {pid}' if pid else 'not running'}")


if __name__ == "__main__":
    cluster()
