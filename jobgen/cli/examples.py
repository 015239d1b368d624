"""``jobgen example NAME DIR``: the example specs, scripts and data jobgen ships, written where
the user wants them (they are package data: a ``pip install``\\ed jobgen has no checkout to copy
them from).

    jobgen example                 # the examples, one line each
    jobgen example sft ./my-first-run [--site NAME] [--force]

Each example is one entry of :data:`EXAMPLES`; its files come from ``jobgen/bundled/examples``
(:data:`jobgen.base.paths.EXAMPLES_DIR`). An existing file is never overwritten without
``--force``, and every file is written to a temporary name and renamed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import click

from jobgen.cli.common import fail

DATA_FILES = ("data/instructions.jsonl", "data/chat.jsonl")
# The example specs name the dev cluster's profile on a line of their own.
SITE_LINE = re.compile(r'^site = "local"$', re.MULTILINE)


@dataclass(frozen=True)
class Example:
    """One example: what it is, the files it writes, and what to run next (DIR is where it went)."""

    name: str
    about: str
    files: tuple[str, ...]
    next_steps: tuple[str, ...]


EXAMPLES: tuple[Example, ...] = (
    Example(
        "sft",
        "supervised fine-tuning of a tiny model on instruction data, 2 nodes x 2 processes (FSDP2, packing, eval)",
        ("sft.toml", *DATA_FILES),
        ("jobgen make-tiny-model DIR/tiny-model", "jobgen validate DIR/sft.toml", "jobgen submit DIR/sft.toml"),
    ),
    Example(
        "hf-sft",
        'your own program: a Hugging Face Trainer script under jobgen (program = "command"), a 3-task array',
        ("hf_sft.toml", "hf_sft.py", *DATA_FILES),
        ("jobgen make-tiny-model DIR/tiny-model", "jobgen submit DIR/hf_sft.toml"),
    ),
    Example(
        "torch-loop",
        "your own program: a plain PyTorch loop that saves and stops with jobgen.runtime.lifecycle()",
        ("torch_loop.toml", "torch_loop.py"),
        ("jobgen submit DIR/torch_loop.toml",),
    ),
    Example(
        "doctor",
        "the node health check: every rank initialises the process group, all-reduces and reports its versions",
        ("doctor.toml",),
        ("jobgen submit DIR/doctor.toml",),
    ),
)


def example_named(name: str) -> Example:
    for example in EXAMPLES:
        if example.name == name:
            return example
    fail(f"no example '{name}'; the examples: {', '.join(e.name for e in EXAMPLES)}")


def example_text(source: Path, site: str | None) -> bytes:
    """The file as shipped; a spec's ``site = "local"`` line names ``site`` instead."""
    data = source.read_bytes()
    if site is None or source.suffix != ".toml":
        return data
    return SITE_LINE.sub(f'site = "{site}"', data.decode()).encode()


def write_example(example: Example, directory: Path, *, site: str | None, force: bool) -> list[Path]:
    """Every file of ``example`` under ``directory``; nothing is written when one exists (and
    ``force`` is not given)."""
    from jobgen.base.atomic import write_bytes_atomic
    from jobgen.base.paths import EXAMPLES_DIR

    targets = [(EXAMPLES_DIR / name, directory / name) for name in example.files]
    existing = [str(target) for _, target in targets if target.exists() or target.is_symlink()]
    if existing and not force:
        fail(f"not overwriting {', '.join(existing)} (--force overwrites)")
    for source, target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(target, example_text(source, site))
    return [target for _, target in targets]


@click.command(name="example")
@click.argument("name", required=False)
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--site", "site", help="the site profile the specs name instead of the dev cluster's ('local')")
@click.option("--force", is_flag=True, help="overwrite files that exist")
def example(name: str | None, directory: str | None, site: str | None, force: bool) -> None:
    """Write the example NAME (its spec, script and data) into DIRECTORY; no NAME: list them."""
    if name is None:
        for entry in EXAMPLES:
            click.echo(f"{entry.name:<12} {entry.about}")
        click.echo("jobgen example NAME DIR writes one")
        return
    chosen = example_named(name)
    if directory is None:
        fail(f"jobgen example {name} DIR: say where to write it")
    if site is not None:
        from jobgen.spec.tables.site import SiteProfile

        try:
            SiteProfile.model_validate({"name": site})
        except ValueError:
            fail(f"--site {site!r}: not a site profile name (letters, digits, '_', '.' and '-')")
    out = Path(directory).expanduser()
    try:
        written = write_example(chosen, out, site=site, force=force)
    except OSError as exc:
        fail(f"could not write the example into {out}: {exc}")
    for path in written:
        click.echo(f"wrote {path}")
    shown = str(out)
    click.echo("next:")
    for step in chosen.next_steps:
        click.echo(f"  {step.replace('DIR', shown)}")
