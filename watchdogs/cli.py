"""``jobgen watchdog``: install, list and remove the scheduler chains; run a check by hand.

jobgen watchdog install [RUN] [--partition P]
jobgen watchdog list [RUN | --home DIR] [--json]
jobgen watchdog remove [RUN | --home DIR]

Without RUN: install covers every active run under the runs root, the runs root's
filesystem, and runs that become active later (watchdogs.runs_root); list and remove
cover every watchdog home the user has.
jobgen watchdog run NAME [RUN] [--path P]... [--notify] [--json]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from watchdogs import CHECKS


def _run(ref: str):
    """A run by name, by directory, or by the run.toml it was submitted from."""
    from jobgen.runs.rundir import RunDir, RunDirError, default_runs_root
    from jobgen.spec.loader import SpecError, load_run

    if ref.endswith(".toml") and Path(ref).is_file():
        try:
            run = RunDir(load_run(ref).run_dir)
        except SpecError as exc:
            raise click.ClickException(str(exc)) from None
        if not run.exists():
            raise click.ClickException(f"{ref}: run {run.path} does not exist yet; `jobgen submit {ref}` first")
        return run
    from jobgen.runs.sweep_runs import find_run_or_point

    try:
        return find_run_or_point(ref, default_runs_root())
    except RunDirError as exc:
        raise click.ClickException(str(exc)) from None


def _homes_and_run(run_ref: str | None, home_path: str | None):
    """The watchdog homes to act on (``--home``, else RUN's, else every home the user has)
    and RUN's run dir."""
    from jobgen.runs.rundir import default_runs_root
    from watchdogs.runs_root import known_homes
    from watchdogs.scheduler import WatchdogHome
    from watchdogs.target import watchdog_home

    if home_path:
        return [WatchdogHome(Path(home_path).absolute())], None
    if run_ref:
        run = _run(run_ref)
        return [WatchdogHome(watchdog_home(run.load_spec()))], run
    root = default_runs_root()
    homes = known_homes(root)
    if not homes and root is None:
        raise click.ClickException("no runs root known and no watchdog home installed: give RUN or --home")
    return homes or [WatchdogHome(root / ".watchdogs")], None


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) if epoch else "-"


@click.group()
def watchdog() -> None:
    """Scheduled checks as self-resubmitting Slurm jobs: disk, running, hang, memory."""


@watchdog.command()
@click.argument("run_ref", metavar="[RUN]", required=False)
@click.option("--partition", help="partition for the scheduler jobs (default [watchdogs] partition, else the run's)")
def install(run_ref: str | None, partition: str | None) -> None:
    """Write RUN's check job files and start the chains that run them. Idempotent.

    Without RUN: every active run under the runs root, the runs root's filesystem, and a
    sweep that installs the runs that become active later."""
    from jobgen.runs.rundir import default_runs_root
    from jobgen.runs.sweep_runs import find_sweep, point_runs
    from watchdogs.runs_root import remember_home
    from watchdogs.scheduler import WatchdogHome, install_run
    from watchdogs.target import watchdog_home

    if run_ref is None:
        _install_root(partition)
        return
    sweep = find_sweep(run_ref, default_runs_root())
    # A sweep: every point that has a run directory, each watched as the run it is.
    runs = [run for _, run in point_runs(sweep) if run.exists()] if sweep is not None else [_run(run_ref)]
    for run in runs:
        spec = run.load_spec()
        home = WatchdogHome(watchdog_home(spec))
        try:
            lines = install_run(home, run.path, spec, partition)
        except Exception as exc:  # noqa: BLE001 - sbatch's refusal, as submitit reports it
            raise click.ClickException(f"nothing installed for {run.path}: {str(exc).strip()}") from None
        remember_home(home.path)
        for line in lines:
            click.echo(line)
        click.echo(f"home {home.path}")


def _install_root(partition: str | None) -> None:
    from jobgen.runs.rundir import default_runs_root
    from watchdogs.runs_root import install_root

    root = default_runs_root()
    if root is None or not root.is_dir():
        raise click.ClickException(
            f"no runs root to watch ({root or 'none configured'}): give RUN, or set JOBGEN_RUNS_ROOT"
        )
    try:
        lines = install_root(root.absolute(), partition)
    except Exception as exc:  # noqa: BLE001 - sbatch's refusal, as submitit reports it
        raise click.ClickException(f"not everything was installed: {str(exc).strip()}") from None
    for line in lines:
        click.echo(line)
    click.echo(f"runs root {root} (its home {root / '.watchdogs'})")


@watchdog.command(name="list")
@click.argument("run_ref", metavar="[RUN]", required=False)
@click.option(
    "--home", "home_path", type=click.Path(file_okay=False), help="watchdog home (default: RUN's, else the site's)"
)
@click.option("--json", "as_json", is_flag=True)
def list_command(run_ref: str | None, home_path: str | None, as_json: bool) -> None:
    """The chains (job, state, next start) and the last result of every job file; without
    RUN or --home, of every watchdog home the user has."""
    homes, _ = _homes_and_run(run_ref, home_path)
    listing = [_home_listing(home) for home in homes]
    if as_json:
        # One home (RUN or --home): the object as before; several: a list of them.
        click.echo(json.dumps(listing[0] if len(listing) == 1 and (run_ref or home_path) else listing, indent=2))
        return
    for i, entry in enumerate(listing):
        if i:
            click.echo("")
        _echo_home(entry)


def _home_listing(home) -> dict:
    from jobgen.slurm import client as slurm

    chains = []
    for chain in home.chains():
        try:
            queued = home.queued_links(chain.name)
        except slurm.SlurmError as exc:
            raise click.ClickException(str(exc)) from None
        jobs = [{"job_id": j.job_id, "state": j.state, "start": j.start_time} for j in queued]
        files = []
        for path in home.job_files(chain.name):
            result_path = home.result_file(chain.name, path.name)
            last = json.loads(result_path.read_text()) if result_path.is_file() else None
            files.append({"job_file": str(path), "last": last})
        chains.append(
            {
                "name": chain.name,
                "every_seconds": chain.seconds,
                "recorded_job": chain.job_id,
                "last_link": chain.last_link,
                "last_start": chain.last_start,
                "jobs": jobs,
                "alive": any(j["job_id"] == chain.job_id for j in jobs),
                "job_files": files,
            }
        )
    return {"home": str(home.path), "chains": chains}


def _echo_home(entry: dict) -> None:
    from jobgen.base.visible import visible

    click.echo(f"home {entry['home']}")
    chains = entry["chains"]
    if not chains:
        click.echo("no chains: `jobgen watchdog install [RUN]` starts them")
    for chain in chains:
        state = ", ".join(f"job {j['job_id']} {j['state']} (start {j['start']})" for j in chain["jobs"])
        if not chain["alive"]:
            state = f"DEAD: recorded job {chain['recorded_job']} is gone; `jobgen watchdog install` restarts it"
        click.echo(
            f"\ncron.{chain['name']}: {state}; last tick {_when(chain['last_start'])} (job {chain['last_link'] or '-'})"
        )
        for f in chain["job_files"]:
            last = f["last"]
            if last is None:
                click.echo(f"  {visible(Path(f['job_file']).name):<32} not run yet")
                continue
            first = str(last.get("output") or "").strip().splitlines()[:1]
            name = visible(Path(f["job_file"]).name)  # a check's output quotes a run's files
            click.echo(
                f"  {name:<32} {_when(last.get('started'))}  exit {last.get('exit_code')}  "
                f"{visible(first[0][:120]) if first else ''}"
            )


@watchdog.command()
@click.argument("run_ref", metavar="[RUN]", required=False)
@click.option(
    "--home", "home_path", type=click.Path(file_okay=False), help="watchdog home (default: RUN's, else the site's)"
)
def remove(run_ref: str | None, home_path: str | None) -> None:
    """With RUN: delete its job files, and stop chains left with none. Without: stop every
    chain of every watchdog home the user has (or of --home) and delete the runs root's
    own job files; runs' job files stay for a later install."""
    from watchdogs.runs_root import root_job_files
    from watchdogs.scheduler import stop_chain

    homes, run = _homes_and_run(run_ref, home_path)
    for home in homes:
        if len(homes) > 1:
            click.echo(f"home {home.path}")
        if run is not None:
            name = run.load_spec().run.job.name
            for path in sorted(home.job_files_of_run(name)):
                path.unlink()
                click.echo(f"removed {path}")
        else:
            for path in sorted(root_job_files(home)):
                path.unlink()
                click.echo(f"removed {path}")
        for chain in home.chains():
            if run is not None and home.job_files(chain.name):
                click.echo(f"chain {chain.name} kept: {len(home.job_files(chain.name))} job file(s) left")
                continue
            cancelled = stop_chain(home, chain.name)
            click.echo(
                f"chain {chain.name} stopped"
                + (f" (cancelled job {', '.join(map(str, cancelled))})" if cancelled else "")
            )


# Options of `python -m watchdogs.NAME` that take a value (watchdogs.base.parser).
_VALUE_OPTIONS = {
    "--run",
    "--path",
    "--home",
    "--min-free",
    "--min-free-inodes",
    "--forecast",
    "--stale-after",
    "--max-percent",
}


@watchdog.command(name="run", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("check", metavar="NAME", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, check: str | None, args: tuple[str, ...]) -> None:
    """Run one check now and print its result; exit 1 when it alerts.

    jobgen watchdog run NAME [RUN] [--path P]... [--notify] [--json] [thresholds]: the
    options of `python -m watchdogs.NAME --help`; RUN may come anywhere."""
    import importlib

    if check not in CHECKS:
        click.echo(ctx.get_help() + f"\n\n  NAME is one of: {', '.join(CHECKS)}")
        sys.exit(0 if check in (None, "-h", "--help") else 2)
    argv, expects_value = [], False
    for arg in args:
        if not expects_value and not arg.startswith("-"):
            argv += ["--run", str(_run(arg).path)]
        else:
            argv.append(arg)
        expects_value = not expects_value and arg in _VALUE_OPTIONS
    module = importlib.import_module(f"watchdogs.{check}")
    sys.exit(module.main(argv))
