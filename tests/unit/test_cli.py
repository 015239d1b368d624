"""The command line as a user runs it: fast, no ML imports, switches, --local runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, doctor_spec, jobgen, run_spec, status

HEAVY = ("torch", "transformers", "datasets", "numpy")


def test_cli_imports_no_ml_libraries():
    spec = REPO / "tests" / "golden" / "specs" / "h100-ib-train.toml"
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from jobgen.cli.main import main\n"
        f"r = CliRunner().invoke(main, ['render', {str(spec)!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(main, ['validate', {str(spec)!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_does_not_import_pydantic_or_jinja():
    """`jobgen --help` as a user runs it lists the commands; Python's import profile
    (PYTHONPROFILEIMPORTTIME, on stderr) shows every module it imported."""
    proc = jobgen("--help", env={"PYTHONPROFILEIMPORTTIME": "1"}, check=True)
    assert "submit" in proc.stdout and "validate" in proc.stdout, proc.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert {"click", "jobgen"} <= imported, sorted(imported)  # the profile saw the CLI's own imports
    assert not imported & {"pydantic", "jinja2", "torch"}, sorted(imported & {"pydantic", "jinja2", "torch"})


def test_switch_commands_create_the_files(tmp_path: Path):
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    spec = load_run(doctor_spec(tmp_path, "switchy"))
    run, _ = materialize(spec, render(spec), None)
    env = {"JOBGEN_RUNS_ROOT": str(tmp_path / "runs")}
    for command, switch in (("stop", "kill"), ("save", "save"), ("abort", "abort")):
        proc = jobgen(command, "switchy", env=env, check=True)
        assert (run.switches / switch).exists(), proc.stdout
    assert jobgen("stop", "no-such-run", env=env).returncode == 1
    view = status(run.path)
    assert view["state"] == "stopped" and view["switches"] == ["abort", "kill", "save"]


def test_stop_never_sets_a_switch_through_a_linked_switches_directory(tmp_path: Path):
    """A switches/ that is a symbolic link (to another run's) is refused in one line: `jobgen
    stop` acts on the run it was given, never on the directory a link leads to."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    spec = load_run(doctor_spec(tmp_path, "linked"))
    run, _ = materialize(spec, render(spec), None)
    other = tmp_path / "other-switches"
    other.mkdir()
    shutil.rmtree(run.switches)
    run.switches.symlink_to(other)
    proc = jobgen("stop", str(run.path))
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stdout + proc.stderr
    assert "symbolic link" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert list(other.iterdir()) == []


@pytest.mark.torch
def test_local_run_of_the_doctor_keeps_user_values_inert(tmp_path: Path):
    """`submit --local` runs the same rendered script without Slurm; an env value full of
    shell syntax arrives verbatim and runs nothing."""
    pytest.importorskip("torch")
    marker = tmp_path / "pwned"
    spec_file = doctor_spec(
        tmp_path,
        "doc-local",
        nodes=1,
        procs_per_node=2,
        extra=f"""
        [env]
        NASTY = "it's $(touch {marker}) `touch {marker}`; touch {marker}"
    """,
    )
    proc = jobgen("submit", str(spec_file), "--local", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: all 2 ranks OK on 1 node(s)" in proc.stdout
    run = tmp_path / "runs" / "doc-local"
    verdict = json.loads((run / "doctor.json").read_text())
    assert verdict["ok"] and verdict["world_size"] == 2
    assert not marker.exists()
    (repro,) = (run / "repro").iterdir()
    env_lines = (repro / "env.txt").read_text().splitlines()
    assert f"NASTY=it's $(touch {marker}) `touch {marker}`; touch {marker}" in env_lines
    for name in ("nodes.txt", "pip-freeze.txt", "git-commit.txt", "versions.json"):
        assert (repro / name).stat().st_size > 0, name
    assert json.loads((repro / "versions.json").read_text())["torch"].startswith("2.")


def test_local_refuses_multi_node(tmp_path: Path):
    spec_file = doctor_spec(tmp_path, "two", nodes=2)
    proc = jobgen("submit", str(spec_file), "--local")
    assert proc.returncode == 2 and "job.nodes" in proc.stderr
    assert not (tmp_path / "runs" / "two").exists()


def test_status_reports_a_run_with_a_corrupt_spec_and_lists_the_others(tmp_path: Path):
    """One broken spec.json must not hide every other run from `jobgen status`."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    runs = {}
    for name in ("alpha", "broken", "zulu"):
        spec = load_run(doctor_spec(tmp_path, name))
        runs[name], _ = materialize(spec, render(spec), None)
    bad = runs["broken"].spec_file
    bad.write_text(bad.read_text()[:100])
    env = {"JOBGEN_RUNS_ROOT": str(tmp_path / "runs")}

    proc = jobgen("status", env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # One line per run, the unreadable one with its file and error in full below.
    table = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines()[1:4]}
    assert table == {"alpha": "unknown", "broken": "unreadable", "zulu": "unknown"}, proc.stdout
    assert f"broken: {bad}: invalid JSON: " in proc.stdout
    listed = json.loads(jobgen("status", "--json", env=env).stdout)
    assert [(s["name"], s["state"] == "unreadable") for s in listed] == [
        ("alpha", False),
        ("broken", True),
        ("zulu", False),
    ], listed
    assert listed[1]["run_dir"] == str(runs["broken"].path) and listed[1]["warnings"][0].startswith(f"{bad}: ")

    for args in (("status", "broken"), ("status", "broken", "--json"), ("status", "broken", "--watch")):
        proc = jobgen(*args, env=env)
        assert proc.returncode == 1 and proc.stdout == "", (args, proc.stdout)
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"jobgen: {bad}: invalid JSON: "), proc.stderr

    # Valid JSON that is not a resolved spec: the key is named.
    bad.write_text(
        json.dumps(
            {
                **json.loads(runs["alpha"].spec_file.read_text()),
                "run": {"job": {"name": "broken", "time": "5m", "nodes": 0}},
            }
        )
    )
    proc = jobgen("status", "broken", env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"jobgen: {bad}: run.job.nodes: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_a_fifo_as_the_failed_marker_never_holds_the_batch_script(tmp_path: Path):
    """The batch script shows the failed marker before it refuses to start: a FIFO (or a
    device) there is not read, so the task ends instead of waiting for a writer forever."""
    import os
    import subprocess

    from jobgen.launch.render import render
    from jobgen.launch.submit import local_environment
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    runs = tmp_path / "runs"
    job = {"nodes": 1, "time": "5m", "exit_grace": "1m", "runs_root": str(runs)}
    spec = load_run(run_spec(tmp_path, "fifo-marker", job=job, model={"path": "model"}, data={"path": "data.jsonl"}))
    run, _ = materialize(spec, render(spec), None)
    os.mkfifo(run.failed_marker)
    proc = subprocess.run(
        ["bash", str(run.script(spec.run.job.program))],
        env=local_environment(spec, 7),
        cwd=run.path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "would repeat: not starting" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("missing", ["torch", "transformers"])
def test_make_tiny_model_without_the_train_extra_is_one_line_naming_it(tmp_path: Path, missing):
    """Issue 46: without [train], `jobgen make-tiny-model` was a ModuleNotFoundError traceback.
    The module is hidden from a fresh interpreter as an environment without it lacks it."""
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from jobgen.cli.main import main\n"
        f"main(['make-tiny-model', {str(tmp_path / 'model')!r}])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"jobgen make-tiny-model needs the [train] extra ({missing} is not installed in {sys.prefix}): "
        "pip install 'jobgen[train]'"
    )
    assert not (tmp_path / "model").exists()
