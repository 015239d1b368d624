"""``jobgen samples RUN``: the answers the trainer gave to ``[eval] prompts``, side by side
across evaluations (jobgen.report.samples), the last ones read from the file's end (the command
is built when asked for: jobgen.cli.main's ``lazy`` table).

    jobgen samples RUN                 # the last 10 evaluations
    jobgen samples RUN --all --json    # every evaluation, as JSON
"""

from __future__ import annotations

import json
import shutil

import click

from jobgen.cli.common import fail, find_run

# Evaluations `jobgen samples` shows unless asked for more (--last N, --all, --step).
SAMPLES_LAST = 10


@click.command()
@click.argument("run_ref", metavar="RUN")
@click.option("--step", type=click.IntRange(0), help="only the samples of this step")
@click.option(
    "--last",
    type=click.IntRange(1),
    default=SAMPLES_LAST,
    show_default=True,
    help="only the last N evaluations' samples, read from the file's end",
)
@click.option("--all", "every_step", is_flag=True, help="every evaluation's samples (reads the whole history)")
@click.option("--json", "as_json", is_flag=True, help="a JSON list: each prompt with its completions by step")
def samples(run_ref: str, step: int | None, last: int, every_step: bool, as_json: bool) -> None:
    """The answers to [eval] prompts at each evaluation, side by side across steps: the last
    10 evaluations unless asked for more (--last N, --all) or for one step (--step)."""
    from jobgen.base.visible import visible
    from jobgen.report.samples import NoSamples, format_samples, read_samples, samples_json

    run = find_run(run_ref)

    def warn(line: str) -> None:  # lines that are no samples: skipped, said once
        click.echo(f"jobgen samples: warning: {visible(line)}", err=True)

    try:
        table = read_samples(run, step, warn, last=None if every_step else last)
    except NoSamples as exc:
        fail(f"jobgen samples: {exc}")
    width = shutil.get_terminal_size((100, 24)).columns
    click.echo(json.dumps(samples_json(table), indent=2) if as_json else format_samples(table, width).rstrip("\n"))
    if table.left_out:
        click.echo(f"jobgen samples: the last {last} evaluations; --last N for more, --all for every one", err=True)
