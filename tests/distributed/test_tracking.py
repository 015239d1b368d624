"""A run that resumed twice, one of them after a crash that lost logged steps: TensorBoard's
curve has every step once (the lost steps' events purged), W&B (offline) keeps one run id
across the jobs, and `jobgen plot` draws the run with both resumes marked."""

from __future__ import annotations

import subprocess

import pytest

from helpers import jobgen, losses, make_run, stopped_by_kill_switch, summary, torchrun, wait_for_step
from jobgen.base.exit_codes import ExitCode
from jobgen.runs.rundir import RunDir

pytestmark = pytest.mark.torch
pytest.importorskip("torch")
pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("matplotlib")


def test_tensorboard_wandb_and_plot_across_two_resumes(tmp_path, tiny_model):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jobgen.report.plot import read_plot_data

    run = make_run(
        tmp_path, tiny_model, max_steps=12, save_every_steps=3, log_every_steps=1, report_to=["tensorboard", "wandb"]
    )
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}

    # Job 1 dies outright at step 5 or later: steps 4 and 5 are logged, their checkpoint is not.
    first = torchrun(run, env={**env, "SLURM_JOB_ID": "501"}, background=True)
    wait_for_step(run, first, 5)
    subprocess.run(["pkill", "-KILL", "-P", str(first.pid)], check=False)
    first.kill()
    first.communicate(timeout=60)
    lost = max(losses(run))
    assert lost >= 5

    # Job 2 resumes from step 3 and is stopped with the kill switch; job 3 finishes.
    stopped, out = stopped_by_kill_switch(run, lost + 1, env={**env, "SLURM_JOB_ID": "502"})
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and stopped["start_step"] == 3, out
    third = torchrun(run, env={**env, "SLURM_JOB_ID": "503"})
    assert third.returncode == 0, third.stdout + third.stderr
    assert summary(run)["start_step"] == stopped["end_step"]

    # TensorBoard: steps 1..12 once each, with the values of the jobs that kept them.
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [s.step for s in scalars] == list(range(1, 13)), [s.step for s in scalars]
    kept = losses(run)  # the last value logged for each step
    for s in scalars:
        assert s.value == pytest.approx(kept[s.step], abs=1e-6), s

    # W&B: one id, made by the first job, resumed by the other two.
    run_id = (run / "wandb-id").read_text().strip()
    offline = sorted((run / "wandb" / "wandb").glob("offline-run-*"))
    assert len(offline) == 3 and all(p.name.endswith(f"-{run_id}") for p in offline), offline

    # The plot: both resumes marked, a PNG written atomically.
    data = read_plot_data(RunDir(run))
    assert [step for step, _ in data.resumes] == [3, stopped["end_step"]]
    png = tmp_path / "progress.png"
    assert jobgen("plot", str(run), "-o", str(png), check=True).returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob(".progress.png.tmp-*"))
