"""[command] (job.program = "command"): every mistake is refused with its key, before
anything is written; a good table renders the exact torchrun line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from helpers import spec_issues, write_spec
from jobgen.loader import load_run
from jobgen.render import render

HEAD = """
    site = "local"
    [job]
    name = "own"
    program = "command"
    time = "1h"
    array = 3
"""


@pytest.mark.parametrize(
    "table, key, words",
    [
        pytest.param("", "", "needs a [command] table", id="no-table"),
        pytest.param('[command]\nargs = ["--x"]\n', "command", "exactly one of command.module", id="missing-module"),
        pytest.param(
            '[command]\nmodule = "a.b"\nscript = "train.py"\n', "command", "exactly one of", id="module-and-script"
        ),
        pytest.param('[command]\nscript = "nope.py"\n', "command.script", "'nope.py' is no file", id="no-such-script"),
        pytest.param('[command]\nmodule = "a.b"\nargs = "--lr 1"\n', "command.args", "valid list", id="args-string"),
        pytest.param('[command]\nmodule = "a.b"\nargs = ["--lr", 1]\n', "command.args[1]", "valid string", id="int"),
        pytest.param('[command]\nmodule = "a b"\n', "command.module", "should match pattern", id="bad-module"),
        pytest.param('[command]\nmodule = "a.b"\nworkdir = "nowhere"\n', "command.workdir", "no directory", id="wd"),
        pytest.param('[command]\nmodule = "a.b"\nmodle = "x"\n', "command.modle", "Extra inputs", id="typo"),
        pytest.param('[command]\nmodule = "a.b"\nargs = ["a\\nb"]\n', "command.args[0]", "control", id="newline"),
    ],
)
def test_a_bad_command_table_is_refused_with_its_key(tmp_path: Path, table: str, key: str, words: str):
    found = spec_issues(write_spec(tmp_path, HEAD + table))
    assert key in found and words in found[key], found


def test_command_with_another_program_is_refused(tmp_path: Path):
    spec = HEAD.replace('program = "command"', 'program = "doctor"') + '[command]\nmodule = "a.b"\n'
    found = spec_issues(write_spec(tmp_path, spec))
    assert "only used with job.program = 'command'" in " ".join(found.values()), found


def test_a_script_is_found_from_run_toml_and_its_arguments_stay_words(tmp_path: Path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text("print('hi')\n")
    spec = load_run(
        write_spec(tmp_path, HEAD + '[command]\nscript = "scripts/train.py"\nargs = ["--out", "a b", "$(id)"]\n')
    )
    assert spec.run.command.script == str(tmp_path / "scripts" / "train.py")
    assert spec.run.command.workdir == str(tmp_path)
    text = render(spec)
    assert f"  '{tmp_path}/scripts/train.py' '--out' 'a b' '$(id)'\n" in text
    assert f"cd {tmp_path}\n" in text and "--array=1-3%1" in text


def test_a_newline_in_run_tomls_directory_never_reaches_the_script(tmp_path: Path):
    # The directory's name closes the node script's here-document and runs a command.
    hostile = tmp_path / "x\nNODE\ntouch /tmp/jobgen-pwned\necho '"
    hostile.mkdir(parents=True)  # its "/" make it three directories, as in the audit
    (hostile / "train.py").write_text("print('hi')\n")
    spec = write_spec(hostile, HEAD + '[command]\nscript = "train.py"\n')
    found = spec_issues(spec)
    assert "control character" in found.get("command.workdir", ""), found
    assert "control character" in found.get("command.script", ""), found
    # And render itself refuses such a word, should one ever get past the loader.
    good = write_spec(tmp_path, HEAD + '[command]\nmodule = "a.b"\n')
    spec = load_run(good)
    command = spec.run.command.model_copy(update={"workdir": str(hostile)})
    smuggled = dataclasses.replace(spec, run=spec.run.model_copy(update={"command": command}))
    with pytest.raises(ValueError, match="control character"):
        render(smuggled)
