"""docs/your-cluster.md: every ``jobgen`` command it shows is one the command line has, with
options its ``--help`` lists (the path as a whole runs in tests/cluster/test_slurm_wheel.py)."""

from __future__ import annotations

import re
import shlex

import click

from helpers import REPO
from jobgen.cli.main import main

DOC = REPO / "docs" / "your-cluster.md"


def shown_commands() -> list[list[str]]:
    """The words of every `jobgen ...` line in the page's bash blocks (comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("jobgen ")]


def command_for(words: list[str]) -> tuple[click.Command, list[str]]:
    """The (sub)command the words name, and the words after its name."""
    command: click.Command = main
    ctx = click.Context(main)
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        found = command.get_command(ctx, words[0])
        assert found is not None, f"jobgen has no command {words[0]!r}"
        command, words = found, words[1:]
    return command, words


def test_every_command_and_option_on_the_page_exists():
    shown = shown_commands()
    assert len(shown) >= 10, shown
    for words in shown:
        command, rest = command_for(words)
        options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        options |= {"--help", "-h"} | ({"--version"} if command is main else set())
        for word in rest:
            if word.startswith("--"):
                assert word.split("=")[0] in options, f"`jobgen {' '.join(words)}`: {word} is not an option"


def test_the_readme_links_it_on_its_first_screen():
    first_screen = "\n".join((REPO / "README.md").read_text().splitlines()[:30])
    assert "docs/your-cluster.md" in first_screen
