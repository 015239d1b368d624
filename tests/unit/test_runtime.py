"""jobgen.runtime without a cluster: the stop rules a user's program gets (the bundled
trainer's own), the records it leaves for the batch script, status and goodput, and the
Hugging Face callback's decisions. The whole chain on Slurm is tests/cluster/test_slurm_command.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from jobgen.base.exit_codes import ExitCode
from jobgen.runs.jsonl_records import read_jsonl
from jobgen.runs.quarantine import read_rank_ends
from jobgen.runtime import Action, Job, NotUnderJobgen, lifecycle
from run_dirs import command_run, job_environ


def test_the_runtime_imports_no_torch():
    code = "import sys, jobgen.runtime; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_switches_and_the_deadline_are_the_trainers_rules(tmp_path: Path):
    run = command_run(tmp_path)
    job = Job(run.path, job_environ())
    assert job.checkpoint_dir == run.checkpoints and not job.resuming
    assert not (job.stop_requested() or job.save_requested() or job.abort_requested())
    (run.switches / "save").touch()
    assert job.save_requested() and not job.stop_requested()
    (run.switches / "kill").touch()
    assert job.stop_requested() and job.action() is Action.KILL
    (run.switches / "abort").touch()
    assert job.abort_requested() and not job.stop_requested()
    # exit_grace (60 s) before the job's end: save and leave.
    late = Job(command_run(tmp_path / "late").path, job_environ(end_in=30))
    assert late.deadline is not None and late.action() is Action.DEADLINE


def test_only_rank_0_reads_the_switch_files(tmp_path: Path):
    run = command_run(tmp_path)
    (run.switches / "kill").touch()
    assert Job(run.path, job_environ(rank=0)).stop_requested()
    assert not Job(run.path, job_environ(rank=1)).stop_requested()  # agreed_action spreads rank 0's view


def test_a_loop_stopped_by_the_kill_switch_leaves_its_exit_for_the_batch_script(tmp_path: Path):
    run = command_run(tmp_path)
    (run.checkpoints / "step-3.pt").write_text("x")
    job = Job(run.path, job_environ())
    assert job.resuming
    with lifecycle(start_step=3, job=job) as life:
        for step in range(3, 100):
            if step == 6:
                (run.switches / "kill").touch()
            action = life.step_done(step + 1, loss=1.0 / (step + 1))
            if action.saves:
                life.saved()
            if action.exits:
                break
    assert life.step == 7
    code, words = run.exit_code_file("77", 0).read_text().splitlines()
    assert int(code) == ExitCode.KILL_SWITCH and words.startswith("kill switch"), words
    tasks = read_jsonl(run.path / "tasks.jsonl")
    assert [t["event"] for t in tasks] == ["first_step", "exit"]
    assert tasks[0]["start_step"] == 3 and tasks[0]["step"] == 4
    assert tasks[1]["end_step"] == 7 and tasks[1]["exit_code"] == ExitCode.KILL_SWITCH
    assert len(tasks[1]["save_seconds"]) == 1
    assert [m["step"] for m in read_jsonl(run.path / "metrics.jsonl")] == [4, 5, 6, 7]
    assert not run.done_marker.exists()


def test_a_stop_request_acted_on_is_spent(tmp_path: Path):
    run = command_run(tmp_path)
    request = run.stop_request("77", 0)
    request.write_text("USR1\n")  # the batch shell's trap: Slurm's lead-time signal
    with lifecycle(job=Job(run.path, job_environ())) as life:
        action = life.step_done(1)
        assert action is Action.SIGNAL
        life.saved()
    assert not request.exists()
    assert run.exit_code_file("77", 0).read_text().startswith("12\ntime limit (USR1 60 s before the limit)")


def test_the_reason_gives_the_lead_time_the_signal_really_gave(tmp_path: Path):
    """Slurm sends its lead-time signal up to a minute earlier than exit_grace asks: the
    reason says how early it came (the batch shell writes the second it caught it)."""
    run = command_run(tmp_path)  # exit_grace 1m
    environ = job_environ(end_in=600)
    caught = int(environ["JOBGEN_JOB_END_TIME"]) - 97
    run.stop_request("77", 0).write_text(f"USR1 {caught}\n")
    with lifecycle(job=Job(run.path, environ)) as life:
        assert life.step_done(1) is Action.SIGNAL
        life.saved()
    assert run.exit_code_file("77", 0).read_text().startswith("12\ntime limit (USR1 97 s before the limit)")


def test_a_loop_that_ends_on_its_own_finishes_the_run(tmp_path: Path):
    run = command_run(tmp_path)
    with lifecycle(job=Job(run.path, job_environ())) as life:
        for step in range(3):
            life.step_done(step + 1)
    assert run.done_marker.exists()
    assert run.exit_code_file("77", 0).read_text().startswith("0\nfinished at step 3")


def test_an_exception_is_a_crash_and_the_save_switch_is_consumed(tmp_path: Path):
    run = command_run(tmp_path)
    (run.switches / "save").touch()
    with pytest.raises(ValueError), lifecycle(job=Job(run.path, job_environ())) as life:
        assert life.step_done(1) is Action.SAVE
        life.saved()
        assert not (run.switches / "save").exists()
        raise ValueError("boom")
    code, words = run.exit_code_file("77", 0).read_text().splitlines()
    assert int(code) == ExitCode.CRASHED and words == "crashed: ValueError: boom"
    # The rank's end report, for the batch script's node check (jobgen.runs.quarantine).
    (end,) = read_rank_ends(run, "77", 0)
    assert (end.rank, end.error, end.signalled) == (0, "ValueError", None) and end.waited_seconds < 60


def test_a_signal_only_sets_a_flag_read_at_the_next_step(tmp_path: Path):
    run = command_run(tmp_path)
    job = Job(run.path, job_environ())
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    try:
        with lifecycle(job=job) as life:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert life.should_stop(1) and life.wants_save
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code, words = run.exit_code_file("77", 0).read_text().splitlines()
    assert int(code) == ExitCode.SIGNALLED and words.startswith("SIGUSR1 (scancel --signal)"), words


def test_outside_jobgen_the_lifecycle_says_so(monkeypatch):
    monkeypatch.delenv("JOBGEN_RUN_DIR", raising=False)
    with pytest.raises(NotUnderJobgen), lifecycle():
        pass


def test_hf_resume_takes_the_newest_complete_checkpoint(tmp_path: Path):
    from jobgen.runtime.hf import newest_complete_checkpoint

    assert newest_complete_checkpoint(tmp_path / "none") is None
    for step, state in ((5, {"global_step": 5}), (8, {"global_step": 8}), (12, None), (10, "{cut")):
        directory = tmp_path / f"checkpoint-{step}"
        directory.mkdir()
        if state is not None:
            (directory / "trainer_state.json").write_text(state if isinstance(state, str) else json.dumps(state))
    assert newest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-8")


def test_the_hf_callback_saves_and_stops_the_trainer_on_a_switch(tmp_path: Path):
    from transformers import TrainerControl, TrainerState

    from jobgen.runtime.hf import JobgenCallback

    run = command_run(tmp_path)
    callback = JobgenCallback(Job(run.path, job_environ()))
    state, control = TrainerState(), TrainerControl()
    state.global_step = 40
    callback.on_train_begin(None, state, control)
    state.global_step = 41
    callback.on_log(None, state, control, logs={"loss": 2.5, "learning_rate": 1e-3})
    control = callback.on_step_end(None, state, control)
    assert not (control.should_save or control.should_training_stop)
    (run.switches / "save").touch()
    state.global_step = 42
    control = callback.on_step_end(None, state, control)
    assert control.should_save and not control.should_training_stop
    callback.on_save(None, state, control)
    assert not (run.switches / "save").exists()
    control = TrainerControl()
    (run.switches / "kill").touch()
    state.global_step = 43
    control = callback.on_step_end(None, state, control)
    assert control.should_save and control.should_training_stop
    callback.on_save(None, state, control)
    callback.on_train_end(None, state, control)
    tasks = read_jsonl(run.path / "tasks.jsonl")
    assert tasks[0]["start_step"] == 40 and tasks[-1]["end_step"] == 43
    assert tasks[-1]["exit_code"] == ExitCode.KILL_SWITCH
    assert read_jsonl(run.path / "metrics.jsonl")[-1]["loss"] == 2.5
    assert not run.done_marker.exists()


def test_not_under_jobgen_the_callback_refuses(monkeypatch):
    from jobgen.runtime.hf import JobgenCallback

    monkeypatch.delenv("JOBGEN_RUN_DIR", raising=False)
    with pytest.raises(NotUnderJobgen):
        JobgenCallback()
