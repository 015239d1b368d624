"""The ``jobgen`` commands on a sweep (a run.toml with ``[sweep]``, or its directory):
validate, render, submit, stop/save/abort and status. jobgen.cli.main and jobgen.cli.submit hand
a sweep here; a single run never comes here.

    jobgen submit sweep.toml          # one array, --array=1-TASKS%max_parallel
    jobgen status lr-sweep            # one line per point
    jobgen stop lr-sweep              # every point; jobgen stop lr-sweep/POINT: one
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from jobgen.cli.common import NO_CLUSTER, default_runs_root, fail, load, print_findings, submission_errors


def sweep_file(spec_file: str) -> bool:
    """Whether ``spec_file`` is a sweep (it has a [sweep] table). An unreadable file is not
    decided here: the run loader reports it with its usual message."""
    from jobgen.spec.loader import SpecError, read_toml
    from jobgen.sweep.points import is_sweep

    try:
        return is_sweep(read_toml(Path(spec_file)))
    except SpecError:
        return False


def load_sweep(spec_file: str):
    from jobgen.sweep.points import load_sweep as load_file

    return load(spec_file, load_file)


def point_table(sweep) -> str:
    """The points, one line each: name and overrides."""
    lines = [f"# {len(sweep.points)} point(s), at most {sweep.settings.max_parallel} at once:"]
    for point in sweep.points:
        words = ", ".join(f"{k}={json.dumps(v)}" for k, v in point.overrides.items()) or "(the file as written)"
        lines.append(f"#   {point.name}: {words}")
    return "\n".join(lines)


def validate_sweep(spec_file: str) -> None:
    sweep = load_sweep(spec_file)
    click.echo(f"{spec_file}: ok (a sweep of {len(sweep.points)} point(s) under {sweep.directory})")
    click.echo(point_table(sweep))


def render_sweep_command(spec_file: str, output_dir: str | None) -> None:
    """The sweep's script and the point table; with -o, the sweep's script and each point's,
    laid out as the sweep's directory is (DIR/sweep.sbatch, DIR/points/<point>/)."""
    from jobgen.base.atomic import write_text_atomic
    from jobgen.launch.render import render, script_name
    from jobgen.runs.sweep_files import POINTS_DIR, SWEEP_SCRIPT
    from jobgen.sweep.render import render_sweep

    sweep = load_sweep(spec_file)
    text = render_sweep(sweep)
    if output_dir is None:
        click.echo(text, nl=False)
        click.echo(point_table(sweep))
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / SWEEP_SCRIPT, text, mode=0o755)
    click.echo(str(out / SWEEP_SCRIPT))
    for point in sweep.points:
        target = out / POINTS_DIR / point.name / script_name(point.spec)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(target, render(point.spec), mode=0o755)
        click.echo(str(target))


def submit_sweep_command(spec_file: str, *, after: int | None, dry_run: bool, ignore_memory_plan: bool) -> None:
    from jobgen.sweep.submit import submit_sweep

    sweep = load_sweep(spec_file)
    with submission_errors(NO_CLUSTER):
        result = submit_sweep(
            sweep,
            source_text=Path(spec_file).read_text(),
            after=after,
            dry_run=dry_run,
            ignore_memory_plan=ignore_memory_plan,
        )
    print_findings([f for f in result.findings if f.level != "error" and (dry_run or f.level == "warning")])
    added = f"{len(result.new_points)} new point(s)"
    if result.kept_points:
        added += f", {len(result.kept_points)} kept as they were"
    if dry_run:
        click.echo(f"would write {result.directory} ({added}) and run:\n  {' '.join(result.command)}")
        return
    click.echo(f"submitted job {result.job_id}: sweep {result.directory}, {added}, {result.tasks} task(s)")


def sweep_ref(ref: str) -> Path | None:
    from jobgen.runs.sweep_runs import find_sweep

    return find_sweep(ref, default_runs_root())


def point_ref(ref: str):
    """The point's RunDir for ``SWEEP/POINT``, or None."""
    from jobgen.runs.sweep_runs import find_point

    return find_point(ref, default_runs_root())


def switch_targets(ref: str) -> list | None:
    """The run directories a switch command acts on when ``ref`` names a sweep (every point
    that has one) or a point, else None (a single run: the caller finds it). Each derived
    from the sweep's directory and the point's name; a sweep.json that cannot be read is one
    line and no switch at all (exit status 1)."""
    from jobgen.runs.sweep_runs import SweepError, point_runs

    try:
        directory = sweep_ref(ref)
        if directory is not None:
            return [run for _, run in point_runs(directory) if run.exists()]
        point = point_ref(ref)
    except SweepError as exc:
        fail(f"jobgen: {exc}")
    return [point] if point is not None else None


def status_sweep(directory: Path, as_json: bool) -> None:
    from jobgen.runs.sweep_runs import SweepError
    from jobgen.sweep.status import format_sweep_status, sweep_status

    try:
        status = sweep_status(directory)
    except SweepError as exc:
        fail(f"jobgen: {exc}")
    click.echo(json.dumps(status, indent=2) if as_json else format_sweep_status(status))
