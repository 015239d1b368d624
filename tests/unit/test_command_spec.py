"""[command] (job.program = "command"): every mistake is refused with its key, before
anything is written; a good table renders the exact torchrun line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from helpers import spec_issues, write_spec
from jobgen.launch.render import render
from jobgen.spec.loader import load_run

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
        pytest.param('[command]\nmodule = "a b"\n', "command.module", "is not a Python module name", id="bad-module"),
        pytest.param('[command]\nmodule = "a.b"\nworkdir = "nowhere"\n', "command.workdir", "no directory", id="wd"),
        pytest.param('[command]\nmodule = "a.b"\nmodle = "x"\n', "command.modle", "Extra inputs", id="typo"),
        pytest.param('[command]\nmodule = "a.b"\nargs = ["a\\nb"]\n', "command.args[0]", "control", id="newline"),
        pytest.param(
            '[command]\nmodule = "a.b"\nargs = ["--out", "x", "{rundir}/o"]\n',
            "command.args[2]",
            "unknown placeholder {rundir}",
            id="unknown-placeholder",
        ),
        pytest.param(
            '[command]\nmodule = "a.b"\nargs = ["{latest_checkpoint}"]\n',
            "command.args[0]",
            "cannot be used in command.args: the first task has no checkpoint",
            id="latest-in-args",
        ),
        pytest.param(
            '[command]\nmodule = "a.b"\nargs = ["{run_dir:>9}"]\n', "command.args[0]", "unknown placeholder", id="fmt"
        ),
        pytest.param(
            '[command]\nmodule = "a.b"\nresume_args = ["--from", "{latest_checkpoint"]\n',
            "command.resume_args[1]",
            "a lone '{'",
            id="lone-brace",
        ),
        pytest.param(
            '[command]\nmodule = "a.b"\nresume_args = ["}x"]\n', "command.resume_args[0]", "a lone '}'", id="lone-close"
        ),
        pytest.param(
            '[command]\nmodule = "a.b"\n[env]\nFOO = "{checkpoint_dir}/{step}"\n',
            "env.FOO",
            "unknown placeholder {step}",
            id="env-unknown",
        ),
        pytest.param(
            '[command]\nmodule = "a.b"\n[env]\nCFG = \'{"a": 1}\'\n', "env.CFG", "for literal braces", id="env-json"
        ),
        pytest.param(
            '[command]\nmodule = "a.b"\ncheckpoints = "../x-*"\n',
            "command.checkpoints",
            "'/' cannot be used",
            id="rule-path",
        ),
        pytest.param(
            '[command]\nmodule = "a.b"\nstop_signal = "KILL"\n', "command.stop_signal", "'TERM', 'INT'", id="signal"
        ),
        pytest.param('[command]\nmodule = "a.b"\nhf_trainer = "maybe"\n', "command.hf_trainer", "bool", id="hf-str"),
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
    # The words travel in the task's plan (jobgen.launch.command_plan), never through a shell; the
    # script shows them in a comment and starts jobgen's launcher with the plan.
    assert f"#   {tmp_path}/scripts/train.py --out 'a b' '$(id)'\n" in text
    assert '-m jobgen.runtime.launch --plan "$JOBGEN_RUN_DIR/logs/command-plan.$SLURM_JOB_ID.' in text
    assert "$(id)" not in text.split("NODE_LAUNCH")[1]  # not in the node script
    assert f"cd {tmp_path}\n" in text and "--array=1-3%1" in text


@pytest.mark.parametrize(
    "keys, resolved",
    [("", "TERM"), ("hf_trainer = true\n", "none"), ('hf_trainer = true\nstop_signal = "INT"\n', "INT")],
)
def test_stop_signal_is_stored_resolved(tmp_path: Path, keys: str, resolved: str):
    spec = load_run(write_spec(tmp_path, HEAD + '[command]\nmodule = "a.b"\n' + keys))
    assert spec.run.command.stop_signal == resolved
    assert spec.to_json()["run"]["command"]["stop_signal"] == resolved


def test_braces_in_env_are_placeholders_only_for_a_command_program(tmp_path: Path):
    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    train = HEAD.replace('program = "command"', 'program = "train"') + '[model]\npath = "m"\n[data]\npath = "d.jsonl"\n'
    spec = load_run(write_spec(tmp_path, train + "[env]\nCFG = '{\"a\": 1}'\n"))
    assert spec.run.env["CFG"] == '{"a": 1}' and "export CFG='{\"a\": 1}'" in render(spec)
    command = HEAD + '[command]\nmodule = "a.b"\n[env]\nCFG = \'{{"a": 1}}\'\nNOTE = "{task} of {job_id}"\n'
    text = render(load_run(write_spec(tmp_path, command)))
    assert "export CFG='{\"a\": 1}'" in text  # a literal brace, written twice
    assert "export NOTE" not in text and "# NOTE: set for each task by jobgen's launcher" in text


@pytest.mark.parametrize(
    "keys, level, words",
    [
        ("hf_trainer = true\n", "info", "saves a checkpoint when the signal arrives"),
        ('resume_args = ["--resume", "{latest_checkpoint}"]\n', "warning", "forwards SIGTERM to your program"),
        ('stop_signal = "INT"\n', "warning", "forwards SIGINT to your program: no save is asked for"),
        ('stop_signal = "none"\n', "info", "must read jobgen's stop request itself"),
    ],
)
def test_validate_says_what_the_program_gets_at_a_time_limit(tmp_path: Path, keys: str, level: str, words: str):
    from helpers import jobgen

    spec = write_spec(tmp_path, HEAD + '[command]\nmodule = "a.b"\n' + keys)
    proc = jobgen("validate", str(spec))
    assert proc.returncode == 0, proc.stderr
    assert f"{level}: command" in proc.stdout + proc.stderr and words in proc.stdout + proc.stderr
    if level == "warning":
        assert "hf_trainer = true" in proc.stderr and "jobgen.runtime" in proc.stderr


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


def test_submit_tells_the_same_as_a_warning(tmp_path: Path):
    from jobgen.launch.submit import submit

    spec = load_run(
        write_spec(tmp_path, HEAD.replace("[job]", "[job]\nruns_root = 'runs'") + '[command]\nmodule = "a.b"\n')
    )
    result = submit(spec, dry_run=True, skip_preflight=True)
    (finding,) = [f for f in result.findings if f.key.startswith("command")]
    assert finding.level == "warning" and "each array task starts over" in finding.message
