"""What goes wrong only over hours, many saves and requeues, proved on the trainer itself.

Each test reproduces one defect of a long run (issue 9) with the real entry point,
``torchrun -m trainer`` with 2 processes on gloo, or the rendered batch script run
on this machine the way ``jobgen submit --local`` runs it:

- ranks that disagree about a time-based save (a rank whose clock runs fast);
- a checkpoint that fails to load is set aside, never counted, resumed or exported;
- requests and exit codes of an earlier attempt of the same job id are never acted on;
- failures that would repeat stop the run instead of burning the array;
- one writer per run directory;
- RNG files are loaded without unpickling arbitrary objects.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import (
    REPO,
    VENV_BIN,
    checkpoints,
    fault_dir,
    jobgen,
    losses,
    make_run,
    read_jsonl,
    status,
    summary,
    torchrun,
    torchrun_many,
    wait_for_step,
)
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch


def with_fault(directory: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{directory}{os.pathsep}{REPO}"}


def export(run: Path, target: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "jobgen"), "export", str(run), "--to", str(target), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def edit_spec(run: Path, **train: object) -> None:
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["train"].update(train)
    (run / "spec.json").write_text(json.dumps(spec))


# ---------------------------------------------------------------- 1. agreed decisions


def test_time_based_saves_are_agreed_when_a_rank_clock_runs_fast(tmp_path, tiny_model):
    """Each rank used to decide ``save_every`` from its own clock: the rank whose clock
    says "due" entered the save's collectives while the other trained on, and the job
    died at the collective timeout. Rank 1's clock here runs 1.7x fast."""
    skew = fault_dir(
        tmp_path,
        """
        import os, time
        if os.environ.get("RANK") == "1":
            _real = time.monotonic
            _start = _real()
            time.monotonic = lambda: _start + (_real() - _start) * 1.7
    """,
    )
    run = make_run(
        tmp_path / "r",
        tiny_model,
        max_steps=40,
        save_every="1s",
        save_every_steps=0,
        keep_checkpoints=100,
        collective_timeout="20s",
    )
    proc = torchrun(run, env=with_fault(skew), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = checkpoints(run)
    assert len(saved) >= 3 and saved[-1] == "step-00000040", saved  # timed saves happened, then the final one
    assert sorted(losses(run)) == list(range(1, 41))


# ---------------------------------------------------------------- 2. broken checkpoints


def _truncate_a_shard(checkpoint: Path, keep: float = 1 / 3) -> None:
    """Cut a shard as a full disk or a killed writer would."""
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: int(shard.stat().st_size * keep)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model):
    """The finished runs the checkpoint tests below damage, trained in one torchrun
    (tests/run_many.py), each for the test named after it."""
    root = tmp_path_factory.mktemp("trained")
    runs = {
        "set aside": make_run(root / "aside", tiny_model, max_steps=6, save_every_steps=2, keep_checkpoints=3),
        "export": make_run(root / "export", tiny_model, max_steps=4, save_every_steps=2, keep_checkpoints=3),
        "rng": make_run(root / "rng", tiny_model, max_steps=2, save_every_steps=1, keep_checkpoints=3),
    }
    proc = torchrun_many(list(runs.values()))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return runs


def test_a_checkpoint_that_fails_to_load_is_set_aside_and_never_trusted_again(trained, tmp_path):
    run = trained["set aside"]
    (run / "done").unlink()
    _truncate_a_shard(run / "checkpoints" / "step-00000006")
    # The same max_steps: the run resumes from step 4 and must save step 6 anew, not
    # take the broken step-6 for "already saved" and write `done` over it.
    proc = torchrun(run)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert summary(run)["start_step"] == 4 and summary(run)["end_step"] == 6
    assert checkpoints(run) == ["step-00000002", "step-00000004", "step-00000006"]
    (aside,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("broken-")]
    assert aside.name.startswith("broken-step-00000006")
    assert "step-00000006" in (aside / "broken.json").read_text()
    target = tmp_path / "exported"
    done = export(run, target)
    assert done.returncode == 0, done.stderr
    assert "step-00000006" in (target / "jobgen_export.txt").read_text()
    view = status(run)
    assert any(aside.name in w for w in view["warnings"]), view


def test_export_takes_the_newest_checkpoint_that_loads_and_says_why(trained, tmp_path):
    run = trained["export"]
    # Cut to almost nothing: the model's tensors, not only the optimizer's, are gone.
    _truncate_a_shard(run / "checkpoints" / "step-00000004", keep=0.01)
    target = tmp_path / "exported"
    proc = export(run, target)
    assert proc.returncode == 0, proc.stderr
    assert "skipped step-00000004" in proc.stdout + proc.stderr
    assert "exported step-00000002" in proc.stdout
    # Asked for by name, a broken checkpoint is a clear error, not a traceback.
    named = export(run, tmp_path / "again", "--checkpoint", "step-00000004")
    assert named.returncode == 2 and "Traceback" not in named.stderr, named.stderr
    assert "step-00000004" in named.stderr and "could not be loaded" in named.stderr


def test_rng_files_are_not_unpickled(trained, tmp_path):
    """A planted pickle in a checkpoint must not run code when the run resumes."""
    run = trained["rng"]
    (run / "done").unlink()
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import torch

    torch.save(Payload(), run / "checkpoints" / "step-00000002" / "rng-rank00000.pt")
    edit_spec(run, max_steps=3)
    proc = torchrun(run)
    assert not marker.exists(), "resume unpickled a planted RNG file"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(run)["start_step"] == 1  # step-2 was set aside, step-1 loaded


# ---------------------------------------------------------------- 3. earlier attempts


def test_a_stop_request_of_an_earlier_attempt_is_ignored(tmp_path, tiny_model):
    """A requeued job keeps its id: a stop request its previous attempt never consumed
    (SIGKILL after KillWait) must not stop the new attempt."""
    run = make_run(tmp_path, tiny_model, max_steps=8)
    (run / "switches" / "stop.4242").touch()  # as the batch shell of attempt 0 left it
    (run / "switches" / "stop.4242.0").touch()
    proc = torchrun(run, env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(run)["exit_code"] == 0 and summary(run)["end_step"] == 8


def run_script_locally(run: Path, job_id: int, restart: int, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The rendered batch script on this machine, as the given attempt of a job."""
    from jobgen.launch.submit import local_environment
    from jobgen.runs.rundir import RunDir

    rd = RunDir(run)
    env = {
        **local_environment(rd.load_spec(), job_id),
        "SLURM_RESTART_COUNT": str(restart),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    return subprocess.run(
        ["bash", str(rd.script("train"))], env=env, cwd=run, capture_output=True, text=True, timeout=timeout
    )


def test_a_crashed_requeued_attempt_reports_its_own_exit_code(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, max_steps=3)
    # Attempt 0 of job 4242 was stopped by a signal and said so in metrics.json.
    (run / "metrics.json").write_text(json.dumps({"job_id": "4242", "restart": 0, "exit_code": 12}, indent=2))
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["model"]["path"] = str(tmp_path / "no-such-model")  # attempt 1 crashes while loading
    (run / "spec.json").write_text(json.dumps(spec))
    proc = run_script_locally(run, 4242, restart=1)
    assert proc.returncode == ExitCode.CRASHED, proc.stdout[-3000:] + proc.stderr[-3000:]


# ---------------------------------------------------------------- 4. shutdown grace


@pytest.mark.full  # a save must outlast torchrun's 30 s default: 40 s however fast the machine
def test_a_save_slower_than_torchruns_default_grace_survives_sigterm(tmp_path, tiny_model):
    """Preemption and scancel send SIGTERM to every process of the step. torchrun's agent
    then killed its workers after 30 s whatever they were doing: a 34 s save was cut.
    The rendered script gives them exit_grace instead."""
    slow = fault_dir(
        tmp_path,
        """
        import os
        if os.environ.get("RANK"):
            import time
            import torch.distributed.checkpoint as dcp
            _save = dcp.save
            def slow_save(*args, **kwargs):
                time.sleep(34)  # longer than torchrun's default 30 s grace
                return _save(*args, **kwargs)
            dcp.save = slow_save
    """,
    )
    run = make_run(tmp_path / "r", tiny_model, max_steps=100_000)
    from jobgen.launch.submit import local_environment
    from jobgen.runs.rundir import RunDir

    rd = RunDir(run)
    env = {**local_environment(rd.load_spec(), 4343), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **with_fault(slow)}
    proc = subprocess.Popen(
        ["bash", str(rd.script("train"))],
        env=env,
        cwd=run,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_step(run, proc, 3, timeout=240)
        os.killpg(proc.pid, signal.SIGTERM)  # what Slurm does to every process of the step
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    info = summary(run)
    assert info["exit_code"] == ExitCode.SIGNALLED, out[-3000:]
    assert checkpoints(run) == [f"step-{info['end_step']:08d}"], out[-3000:]
    assert proc.returncode == ExitCode.SIGNALLED, out[-3000:]


# ---------------------------------------------------------------- 5. failures that repeat


@pytest.mark.parametrize(
    "cause",
    [
        "world-size",
        pytest.param("seed", marks=pytest.mark.full),
        pytest.param("no-loadable-checkpoint", marks=pytest.mark.full),
    ],
)
def test_a_failure_that_would_repeat_stops_the_run(tmp_path, tiny_model, cause):
    run = make_run(tmp_path, tiny_model, max_steps=2, save_every_steps=1, keep_checkpoints=2)
    expected = {
        "world-size": ExitCode.WORLD_SIZE_MISMATCH,
        "seed": ExitCode.RESUME_MISMATCH,
        "no-loadable-checkpoint": ExitCode.RESUME_FAILED,
    }[cause]
    if cause == "world-size":
        proc = torchrun(run, expected=4)
    else:
        assert torchrun(run).returncode == 0
        (run / "done").unlink()
        if cause == "seed":
            edit_spec(run, max_steps=4, seed=99)
        else:
            edit_spec(run, max_steps=4)
            for ckpt in (run / "checkpoints").glob("step-*"):
                _truncate_a_shard(ckpt)
        proc = torchrun(run)
    out = proc.stdout + proc.stderr
    assert f"exit {int(expected)}" in out, out[-3000:]
    failed = json.loads((run / "failed").read_text())
    assert failed["exit_code"] == expected and failed["reason"] and failed["fix"], failed
    # The batch script of every later array task leaves before it launches anything.
    script = run_script_locally(run, 5151, restart=0)
    assert script.returncode == 0, script.stdout + script.stderr
    assert "failed" in script.stdout and "torchrun" not in script.stdout + script.stderr
    assert not (run / "logs" / "ranks" / "5151").exists()
    view = status(run)
    assert view["state"] == "failed" and any(failed["fix"] in n for n in view["notes"]), view


# ---------------------------------------------------------------- 10. one writer


def test_a_second_writer_is_refused_and_touches_nothing(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, max_steps=400, save_every_steps=5, keep_checkpoints=50)
    first = torchrun(run, background=True, env={"SLURM_JOB_ID": "1111"})
    try:
        wait_for_step(run, first, 3)
        before = sorted(p.name for p in (run / "checkpoints").iterdir())
        second = torchrun(run, env={"SLURM_JOB_ID": "2222"}, timeout=240)
        out = second.stdout + second.stderr
        assert f"exit {int(ExitCode.RUN_BUSY)}" in out, out[-3000:]
        assert "job 1111" in out and "pid" in out, out[-3000:]  # names the holder
        after = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert set(before) <= set(after)  # nothing of the holder's was deleted
        assert not any(r.get("job_id") == "2222" for r in read_jsonl(run / "tasks.jsonl"))
        local = jobgen("submit", "--local", str(tmp_path / "sft.toml"), cwd=tmp_path)
        assert local.returncode != 0 and "job 1111" in local.stderr, local.stdout + local.stderr
    finally:
        (run / "switches" / "kill").touch()
        first.communicate(timeout=180)
    assert summary(run)["exit_code"] == ExitCode.KILL_SWITCH and summary(run)["job_id"] == "1111"
