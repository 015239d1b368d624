"""``jobgen site init NAME``: a site profile read from the cluster itself (the command group is
built when asked for: jobgen.cli.main's ``lazy`` table).

    jobgen site init NAME [--partition P] [--runs-root DIR] [--ifname IF] [--transport socket|ib]
                          [--account A] [--qos Q] [--reservation R] [--force] [--print]

Slurm says the partitions, the nodes' CPUs, memory and GPUs (:mod:`jobgen.sites.inventory`);
the flags say the rest (:class:`jobgen.sites.profile_writer.ProfileChoices`). The profile goes to
``$XDG_CONFIG_HOME/jobgen/sites/NAME.toml`` (:mod:`jobgen.sites.config_dir`), or to stdout.
"""

from __future__ import annotations

import click

from jobgen.cli.common import NO_CLUSTER, fail


@click.group(name="site")
def site() -> None:
    """Site profiles: what jobgen knows of your cluster."""


@site.command(name="init")
@click.argument("name")
@click.option("--partition", help="the partition the profile is for [default: the cluster's default partition]")
@click.option(
    "--runs-root",
    default="~/jobgen-runs",
    show_default=True,
    help="where run directories go: a directory every node sees",
)
@click.option("--ifname", help="the nodes' network interface to each other [default: left for `jobgen doctor`]")
@click.option(
    "--transport",
    type=click.Choice(["socket", "ib"]),
    default="socket",
    show_default=True,
    help="'ib' for InfiniBand or RoCE, 'socket' for Ethernet only",
)
@click.option("--account", help="Slurm account to charge (--account)")
@click.option("--qos", help="Slurm quality of service (--qos)")
@click.option("--reservation", help="Slurm reservation to run in (--reservation)")
@click.option(
    "--gpu-compute/--no-gpu-compute",
    default=True,
    show_default=True,
    help="whether ranks compute on the GPUs Slurm gives them (no: the dev cluster's fake GPUs)",
)
@click.option("--force", is_flag=True, help="replace a profile of that name")
@click.option("--print", "to_stdout", is_flag=True, help="print the profile instead of writing it")
def init(name: str, force: bool, to_stdout: bool, **flags: str | bool | None) -> None:
    """Write site profile NAME from what Slurm says of this cluster.

    \b
        jobgen site init NAME [--partition P] [--runs-root DIR] [--ifname IF]
                              [--transport socket|ib] [--account A] [--qos Q]
                              [--reservation R] [--no-gpu-compute] [--force] [--print]

    Slurm says the partitions and each node's CPUs, memory and GPUs; the flags say what it
    cannot. The profile goes to $XDG_CONFIG_HOME/jobgen/sites/NAME.toml (~/.config/jobgen/sites
    without XDG_CONFIG_HOME); --print writes it to stdout instead."""
    from jobgen.sites.profile_writer import ProfileChoices

    text = _profile(name, ProfileChoices(**flags))  # type: ignore[arg-type]
    if to_stdout:
        click.echo(text, nl=False)
        return
    path = _write(name, text, force)
    click.echo(f"wrote {path}")
    click.echo("next:")
    click.echo(f'  in a run.toml, site = "{name}"; then  jobgen validate run.toml')
    click.echo(f"  jobgen doctor --site {name}   # checks every node and finds network.ifname")


def _profile(name: str, choices) -> str:
    """The profile's text, or one line saying why not (Slurm out of reach, a partition that is
    not there, a record or a name that cannot be used)."""
    from jobgen.sites.inventory import InventoryError, read_inventory
    from jobgen.sites.profile_writer import ProfileError, profile_text
    from jobgen.slurm.client import SlurmError, SlurmUnavailable

    try:
        return profile_text(read_inventory(), name, choices)
    except SlurmUnavailable as exc:
        fail(f"jobgen site init: Slurm does not answer: {exc}\n  {NO_CLUSTER}")
    except SlurmError as exc:
        fail(f"jobgen site init: {exc}")
    except (InventoryError, ProfileError) as exc:
        fail(f"jobgen site init {name}: {exc}")


def _write(name: str, text: str, force: bool):
    from jobgen.sites.config_dir import ProfileExists, write_profile

    try:
        return write_profile(name, text, force)
    except ProfileExists as exc:
        fail(f"jobgen site init: {exc}")
    except OSError as exc:
        fail(f"jobgen site init: cannot write the profile: {exc}")
