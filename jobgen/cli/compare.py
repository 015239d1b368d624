"""``jobgen compare``: the command, and the table it prints.

    jobgen compare runs/lr-sweep                  # every point of a sweep, best first
    jobgen compare run-a run-b runs/lr-sweep      # runs and sweeps mixed
    jobgen compare runs/lr-sweep --json
    jobgen compare runs/lr-sweep -o lr-sweep.png  # and the curves overlaid

What it reads and how it sorts is :mod:`jobgen.report.compare`'s. Only ``click`` is imported at
module level: jobgen.cli.main registers the command when it starts, and ``jobgen --help`` must
stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from jobgen.cli.common import default_runs_root, fail


@click.command(name="compare")
@click.argument("refs", metavar="SWEEP|RUN...", nargs=-1, required=True)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="also draw training and eval loss of every run into FILE.png (needs the [plot] extra)",
)
@click.option("--json", "as_json", is_flag=True, help="a JSON list: one object per run, best first")
def compare_command(refs: tuple[str, ...], output: Path | None, as_json: bool) -> None:
    """Runs or sweep points side by side, best first: by best eval loss, then (without
    evaluations) by final training loss. A SWEEP is a directory with sweep.json: each of its
    points is a run, one not yet started listed as pending.

    \b
    jobgen compare runs/lr-sweep -o lr-sweep.png
    jobgen compare run-a run-b --json"""
    from jobgen.report.compare import CompareError, compare, draw

    try:
        rows = compare(list(refs), default_runs_root(), curves=output is not None)
        click.echo(json.dumps([row.to_json() for row in rows], indent=2) if as_json else format_table(rows))
        if output is not None:
            # With --json, stdout is the JSON alone: a script parses it as it is.
            click.echo(f"wrote {draw(rows, output)}", err=as_json)
    except CompareError as exc:
        fail(f"jobgen compare: {exc}", exc.code)


def format_table(rows) -> str:
    """One line per run (``jobgen.report.compare.Row``), columns aligned as ``jobgen status`` aligns
    its listing: name, state, a column per override key (first seen first), step/max_steps,
    final training loss, best eval loss and its step. ``-`` where a value is unknown."""
    from jobgen.base.visible import visible
    from jobgen.report.compare import override_keys, value_text
    from jobgen.report.status_format import step_text

    keys = override_keys(rows)
    # Names, keys and values come from sweep.json and directory names: shown, never acted on.
    table = [["NAME", "STATE", *map(visible, keys), "STEP", "LOSS", "BEST EVAL"]]
    for row in rows:
        best = "-"
        if row.best_eval_loss is not None:
            best = f"{row.best_eval_loss:.4f}" + (
                f" (step {row.best_eval_step})" if row.best_eval_step is not None else ""
            )
        table.append(
            [
                visible(row.name),
                row.state,
                *(visible(value_text(row.overrides[key])) if key in row.overrides else "-" for key in keys),
                step_text(row),  # a Row has the step and max_steps it reads, as a RunStatus does
                f"{row.final_loss:.4f}" if row.final_loss is not None else "-",
                best,
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table)
