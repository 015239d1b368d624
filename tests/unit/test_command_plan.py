"""A command program's task plan (jobgen.launch.command_plan) and the launcher that runs it
(jobgen.runtime.launch): placeholders expanded by jobgen, the checkpoint rules, resume_args
only with a checkpoint, the plan written atomically and refused by any other attempt. The
launcher under torchrun with a real Hugging Face Trainer is
tests/distributed/test_hf_trainer_unedited.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.command_plan import (
    CommandPlan,
    PlanForAnotherAttempt,
    PlanUnreadable,
    build_plan,
    main,
    read_plan,
    write_plan,
)
from jobgen.launch.render import render
from jobgen.program import placeholders
from jobgen.program.checkpoints import latest_checkpoint
from jobgen.runs.rundir import RunDir
from jobgen.spec.loader import resolve

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd(),
                  "note": os.environ.get("NOTE"), "last": os.environ.get("LAST"), "run": os.environ["JOBGEN_RUN_DIR"]}))
"""


def command_run(directory: Path, env: dict[str, str] | None = None, **command: object) -> RunDir:
    """A command run whose script prints what it was started with, and its run directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "prog").mkdir(exist_ok=True)
    (directory / "prog" / "show.py").write_text(SCRIPT)
    job = {"name": "own", "program": "command", "time": "1h", "runs_root": str(directory / "runs"), "array": 4}
    raw = {"site": "local", "job": job, "command": {"script": "prog/show.py", **command}, "env": env or {}}
    spec = resolve(raw, spec_file=None, base_dir=directory)
    run = RunDir(spec.run_dir)
    for sub in ("switches", "logs", "checkpoints"):
        (run.path / sub).mkdir(parents=True)
    run.spec_file.write_text(json.dumps(spec.to_json()))
    return run


def hf_checkpoint(run: RunDir, step: int, state: object = "ok") -> Path:
    """checkpoint-STEP as the Trainer leaves it; ``state`` None for one cut before its last file."""
    path = run.checkpoints / f"checkpoint-{step}"
    path.mkdir()
    if state == "ok":
        state = {"global_step": step}
    if state is not None:
        (path / "trainer_state.json").write_text(state if isinstance(state, str) else json.dumps(state))
    return path


@pytest.mark.parametrize(
    "text, values, expanded",
    [
        ("{run_dir}/out", {"run_dir": "/r"}, "/r/out"),
        ("{{not}} {task}", {"task": "3"}, "{not} 3"),
        ("a}}b{{", {}, "a}b{"),
        ("{job_id}-{task}-{job_id}", {"job_id": "9", "task": "1"}, "9-1-9"),
        ("plain $(id) `x` 'q'", {}, "plain $(id) `x` 'q'"),
    ],
)
def test_placeholders_expand_in_python(text: str, values: dict[str, str], expanded: str):
    assert placeholders.expand(placeholders.check(text, placeholders.IN_ENV, "env"), values) == expanded


@pytest.mark.parametrize(
    "text, allowed, words",
    [
        ("{rundir}", placeholders.IN_ENV, "unknown placeholder {rundir}"),
        ("{0}", placeholders.IN_ENV, "unknown placeholder {0}"),
        ("{run_dir!r}", placeholders.IN_ENV, "unknown placeholder"),
        ("{ task }", placeholders.IN_ENV, "unknown placeholder"),
        ("x{", placeholders.IN_ENV, "a lone '{'"),
        ("}", placeholders.IN_ENV, "a lone '}'"),
        ("{latest_checkpoint}", placeholders.IN_ARGS, "first task has no checkpoint"),
    ],
)
def test_a_bad_placeholder_is_an_error(text: str, allowed: frozenset[str], words: str):
    with pytest.raises(placeholders.PlaceholderError, match=None) as info:
        placeholders.check(text, allowed, "command.args")
    assert words in str(info.value)


def test_the_hf_rule_takes_the_newest_complete_checkpoint(tmp_path: Path):
    run = command_run(tmp_path)
    assert latest_checkpoint(run.checkpoints, "checkpoint-*") is None
    hf_checkpoint(run, 5)
    good = hf_checkpoint(run, 8)
    hf_checkpoint(run, 12, None)  # killed before trainer_state.json
    hf_checkpoint(run, 10, "{cut")  # cut mid-write
    hf_checkpoint(run, 11, {"global_step": 9})  # not the step its name says
    (run.checkpoints / "checkpoint-99").write_text("a file, not a checkpoint")
    assert latest_checkpoint(run.checkpoints, "checkpoint-*") == str(good)
    assert latest_checkpoint(tmp_path / "absent", "checkpoint-*") is None


def test_another_glob_takes_the_highest_number_then_the_newest(tmp_path: Path):
    directory = tmp_path / "ck"
    directory.mkdir()
    for name in ("step-9", "step-00000120", "step-30", ".step-500", "other-700"):
        (directory / name).mkdir()
    assert latest_checkpoint(directory, "step-*") == str(directory / "step-00000120")  # 120 > 30 > 9, not by text
    assert latest_checkpoint(directory, "*.pt") is None
    for name, age in (("last.pt", 30), ("best.pt", 10), ("old.pt", 60)):
        (directory / name).write_text("x")
        os.utime(directory / name, (time.time() - age, time.time() - age))
    assert latest_checkpoint(directory, "*.pt") == str(directory / "best.pt")  # no number: newest by mtime
    (directory / "model-3.pt").write_text("x")
    os.utime(directory / "model-3.pt", (time.time() - 999, time.time() - 999))
    assert latest_checkpoint(directory, "*.pt") == str(directory / "model-3.pt")  # a number ranks above none
    assert latest_checkpoint(directory, "epoch*-step*") is None


def test_resume_args_and_a_checkpoint_variable_appear_only_with_a_checkpoint(tmp_path: Path):
    run = command_run(
        tmp_path,
        env={"NOTE": "task {task} of job {job_id} in {run_dir}", "LAST": "{latest_checkpoint}", "LIT": "{{x}}"},
        args=["--output_dir", "{checkpoint_dir}", "--tag", "{{literal}}"],
        resume_args=["--resume_from_checkpoint", "{latest_checkpoint}"],
    )
    spec = run.load_spec()
    fresh = build_plan(spec, run, "41", 0, "1")
    assert fresh.argv == ["--output_dir", str(run.checkpoints), "--tag", "{literal}"]
    assert fresh.checkpoint is None
    assert fresh.env == {"NOTE": f"task 1 of job 41 in {run.path}", "LIT": "{x}"}  # LAST unset, not empty
    newest = hf_checkpoint(run, 20)
    later = build_plan(spec, run, "42", 0, "2")
    assert later.argv == [*fresh.argv, "--resume_from_checkpoint", str(newest)]
    assert later.env["LAST"] == str(newest) and later.checkpoint == str(newest)
    assert later.script == str(tmp_path / "prog" / "show.py") and later.module is None


def test_the_plan_is_written_atomically_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    run = command_run(tmp_path, args=["a b", "$(id)"])
    plan = build_plan(run.load_spec(), run, "42", 1, "2")
    path = write_plan(run, plan)
    assert path == run.command_plan("42", 1)
    assert read_plan(path, "42", 1) == plan
    # A write that fails before its rename leaves the earlier plan whole, and no temporary file.
    other = build_plan(run.load_spec(), run, "42", 1, "3")

    def fail(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        write_plan(run, other)
    monkeypatch.undo()
    assert read_plan(path, "42", 1).task == "2"
    assert sorted(p.name for p in run.logs.iterdir()) == [path.name]


@pytest.mark.parametrize("job_id, restart", [("43", 1), ("42", 0), ("42", 2)])
def test_a_plan_of_another_attempt_is_refused(tmp_path: Path, job_id: str, restart: int):
    run = command_run(tmp_path)
    path = write_plan(run, build_plan(run.load_spec(), run, "42", 1, "2"))
    with pytest.raises(PlanForAnotherAttempt) as info:
        read_plan(path, job_id, restart)
    assert "written for job 42 attempt 1" in str(info.value)


@pytest.mark.parametrize("text", ['{"version": 1, "job_id": "42"', "[]", '{"version": 99}', "absent"])
def test_a_cut_or_foreign_plan_is_unreadable(tmp_path: Path, text: str):
    path = tmp_path / "plan.json"
    if text != "absent":
        path.write_text(text)
    with pytest.raises(PlanUnreadable):
        read_plan(path, "42", 0)
    good = CommandPlan("42", 0, "1", "/r", "/r/checkpoints", None, "/s.py", ["a"], {}, False, None, "checkpoint-*")
    data = {**good.to_json(), "argv": ["a", 3]}
    path.write_text(json.dumps(data))
    with pytest.raises(PlanUnreadable, match="argv"):
        read_plan(path, "42", 0)


def test_the_head_node_command_writes_the_plan_or_says_why_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = command_run(tmp_path, resume_args=["--resume", "{latest_checkpoint}"])
    hf_checkpoint(run, 3)
    assert main(["--run-dir", str(run.path), "--job", "42", "--restart", "0", "--task", "2"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert read_plan(run.command_plan("42", 0), "42", 0).argv == ["--resume", str(run.checkpoints / "checkpoint-3")]
    run.logs.rename(tmp_path / "logs-away")
    run.logs.write_text("not a directory")
    assert main(["--run-dir", str(run.path), "--job", "43"]) == 1
    assert "could not write this task's command plan" in capsys.readouterr().err


def plan_block(text: str) -> list[str]:
    """The batch script's plan step, as rendered."""
    lines = text.splitlines()
    first = lines.index("# --- Your program's plan for this task ---")
    last = next(i for i in range(first, len(lines)) if lines[i].startswith("write_command_plan ||"))
    return lines[first : last + 1]


def test_the_batch_script_writes_the_plan_before_the_launch_or_fails_the_task(tmp_path: Path):
    run = command_run(tmp_path, args=["{task}"])
    script = plan_block(render(run.load_spec()))
    shell = ['py_on_head() { "$@"; }', 'die() { echo "DIE: $*"; exit 3; }', *script, "echo launched"]
    env = {**os.environ, "RUN_DIR": str(run.path), "SLURM_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "3"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(["bash", "-c", "\n".join(shell)], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "launched" in proc.stdout, proc.stdout + proc.stderr
    assert read_plan(run.command_plan("42", 0), "42", 0).argv == ["3"]
    (run.path / "spec.json").write_text("{cut")
    proc = subprocess.run(["bash", "-c", "\n".join(shell)], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 3 and "DIE: could not write this task's command plan" in proc.stdout
    assert "launched" not in proc.stdout


def launcher(
    run: RunDir, job_id: str, restart: int = 0, cwd: Path | None = None, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m jobgen.runtime.launch`` as torchrun starts it on a rank of job ``job_id``."""
    env = {**os.environ, "JOBGEN_RUN_DIR": str(run.path), "SLURM_JOB_ID": job_id, "RANK": "0", **(extra or {})}
    env.update(SLURM_RESTART_COUNT=str(restart), PYTHONPATH=str(REPO))
    plan = run.command_plan("42", 0)
    cmd = [sys.executable, "-m", "jobgen.runtime.launch", "--plan", str(plan)]
    return subprocess.run(cmd, env=env, cwd=cwd or run.path, capture_output=True, text=True, check=False)


def test_the_launcher_runs_the_script_as_python_would(tmp_path: Path):
    run = command_run(tmp_path, env={"NOTE": "task {task}"}, args=["--out", "{checkpoint_dir}", "$(id)", ""])
    write_plan(run, build_plan(run.load_spec(), run, "42", 0, "7"))
    proc = launcher(run, "42")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    script = str(tmp_path / "prog" / "show.py")
    assert seen["argv"] == [script, "--out", str(run.checkpoints), "$(id)", ""]
    assert seen["path0"] == str(tmp_path / "prog") and seen["name"] == "__main__"
    assert seen["note"] == "task 7" and seen["last"] is None and seen["run"] == str(run.path)


def test_the_launcher_runs_a_module_from_the_workdir(tmp_path: Path):
    run = command_run(tmp_path)
    spec = run.load_spec()
    command = spec.run.command.model_copy(update={"module": "show", "script": None})
    spec = type(spec)(**{**spec.__dict__, "run": spec.run.model_copy(update={"command": command})})
    write_plan(run, build_plan(spec, run, "42", 0, "1"))
    proc = launcher(run, "42", cwd=tmp_path / "prog")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["argv"] == [str(tmp_path / "prog" / "show.py")] and seen["name"] == "__main__"
    assert seen["path0"] == str(tmp_path / "prog")


def test_the_launcher_refuses_an_earlier_attempts_plan(tmp_path: Path):
    run = command_run(tmp_path)
    write_plan(run, build_plan(run.load_spec(), run, "42", 0, "1"))
    proc = launcher(run, "42", restart=1)  # the job was requeued: attempt 1 finds attempt 0's plan
    assert proc.returncode == ExitCode.LAUNCH_ERROR
    assert "written for job 42 attempt 0" in proc.stderr and "show.py" not in proc.stdout
    code, words = run.exit_code_file("42", 1).read_text().splitlines()
    assert int(code) == ExitCode.LAUNCH_ERROR and "refusing to act on another attempt" in words


def test_the_launcher_imports_no_torch():
    code = "import sys, jobgen.runtime.launch; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_launcher_records_each_ranks_global_rank_where_jobgen_logs_reads_it(tmp_path: Path):
    """torchrun's log tree names only a node's local ranks; the launcher leaves the global one."""
    run = command_run(tmp_path)
    write_plan(run, build_plan(run.load_spec(), run, "42", 0, "1"))
    proc = launcher(run, "42", extra={"SLURMD_NODENAME": "node2", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1"})
    assert proc.returncode == 0, proc.stderr
    record = json.loads(run.rank_identity("42", "node2", 0, 1).read_text())
    assert record == {"rank": 3, "group_rank": 1}
