"""The submission core (jobgen.launch.submission) as a run, a sweep and a served model meet it:
what one path did that the others forgot. A continued run whose sbatch fails is left as it was
(its spec, run.toml, script and history), as a sweep's sweep.json is; ``--local`` refuses a run
whose jobs.json cannot record it and one whose checkpoint the next task would refuse, as a
Slurm submission does; a served model's job refuses an unreadable quarantine record in one
line, as a run does; a refused sweep lists the preflight's findings too, as a run does; and a
SIGTERM to ``jobgen submit --local`` stops its job as Slurm would, as ``jobgen serve --local``
does. sbatch and squeue are replaced where nothing is queued (tests/unit/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import DATA, VENV_BIN, run_spec, small_sweep, wait_for
from jobgen.launch import executors
from jobgen.launch.preflight import Finding
from jobgen.launch.render import render
from jobgen.launch.submission import SubmitError
from jobgen.launch.submit import run_local, submit
from jobgen.runs.materialize import materialize
from jobgen.runs.rundir import RunDir, checkpoint_name
from jobgen.slurm import client as slurm
from jobgen.slurm.client import SlurmError
from jobgen.spec.loader import load_run
from jobgen.sweep.points import load_sweep
from jobgen.sweep.submit import submit_sweep

# A program of the user's that runs until jobgen asks it to stop (jobgen.runtime), and says so.
STOPPABLE = """\
import time
from jobgen import runtime

job = runtime.current()
(job.run_dir / "started").write_text("")
while not job.stop_requested():
    time.sleep(0.2)
(job.run_dir / "stopped").write_text("")
"""


def command_run(tmp_path: Path, args: list[str] | None = None) -> Path:
    (tmp_path / "prog.py").write_text(STOPPABLE)
    job = {"program": "command", "time": "5m", "exit_grace": "1m", "runs_root": str(tmp_path / "runs")}
    command = {"script": "prog.py", "args": args or [], "stop_signal": "none"}  # it reads jobgen's stop request
    return run_spec(tmp_path, "core", job=job, command=command)


def refuse(script: Path, options: list[str]) -> int:
    raise SlurmError(["sbatch"], 1, "sbatch: error: invalid partition")


def test_a_continued_run_whose_sbatch_fails_is_left_as_it_was(tmp_path: Path, sbatch_calls, monkeypatch):
    """A job of the run may still be queued (chained with --after): its next task reads
    spec.json, which must not be a spec that was never submitted."""
    spec_file = command_run(tmp_path, ["--lr", "1"])
    submit(load_run(spec_file), source_text=spec_file.read_text(), skip_preflight=True)
    run = RunDir(tmp_path / "runs" / "core")
    before = {p: p.read_bytes() for p in (run.spec_file, run.path / "run.toml", run.script("command"))}
    history = sorted(os.listdir(run.path / "history"))
    monkeypatch.setattr(slurm, "sbatch", refuse)
    spec_file.write_text(spec_file.read_text().replace('"1"', '"2"'))
    with pytest.raises(SlurmError):
        submit(load_run(spec_file), source_text=spec_file.read_text(), after=101, skip_preflight=True)
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(os.listdir(run.path / "history")) == history  # no record of a spec it never had
    assert len(run.jobs()) == 1


def test_local_refuses_a_run_whose_jobs_json_cannot_record_it_before_changing_anything(tmp_path: Path):
    from jobgen.cli.main import main

    spec_file = command_run(tmp_path)
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), None)
    run.failed_marker.write_text(json.dumps({"reason": "data error"}))
    run.jobs_file.write_text("[{")
    result = CliRunner().invoke(main, ["submit", "--local", str(spec_file)])
    assert result.exit_code == 2, result.output
    assert "the run's submissions cannot be recorded" in result.output and str(run.jobs_file) in result.output
    assert json.loads(run.failed_marker.read_text()) == {"reason": "data error"}  # the failure still stands
    assert os.listdir(run.path / "history") == [] and not list(run.logs.iterdir())  # nothing ran


def test_local_refuses_a_checkpoint_the_next_task_would_refuse(tmp_path: Path, tiny_model: Path):
    """Another global batch than the checkpoint's: refused before spec.json is replaced, as a
    Slurm submission is (jobgen.launch.resume_check)."""

    def batch_spec(grad_accum: int) -> Path:
        job = {"time": "5m", "exit_grace": "1m", "runs_root": str(tmp_path / "runs")}
        train = {"micro_batch_size": 4, "grad_accum": grad_accum, "max_steps": 20}
        return run_spec(
            tmp_path, "batch", job=job, model={"path": str(tiny_model)}, data={"path": str(DATA)}, train=train
        )

    spec = load_run(batch_spec(2))
    run, _ = materialize(spec, render(spec), None)
    saved = run.checkpoints / checkpoint_name(10)
    saved.mkdir()
    shape = {"micro_batch_size": 4, "grad_accum": 2, "world_size": 1}
    (saved / "trainer_state.json").write_text(json.dumps({"batch": shape}))
    spec_json = run.spec_file.read_bytes()
    changed = batch_spec(4)
    with pytest.raises(SubmitError) as refused:
        run_local(load_run(changed), source_text=changed.read_text())
    assert [f.key for f in refused.value.findings if f.level == "error"] == ["train.global_batch_size"]
    assert run.spec_file.read_bytes() == spec_json and not list(run.logs.iterdir())


def test_serve_refuses_an_unreadable_quarantine_record_in_one_line(tmp_path: Path, sbatch_calls):
    from jobgen.cli.serve import serve_command

    spec = load_run(
        run_spec(
            tmp_path,
            "llm",
            job={"time": "1h", "runs_root": "runs"},
            model={"path": "org/model"},
            data={"path": str(DATA)},
        )
    )
    run, _ = materialize(spec, render(spec), None)
    (run.checkpoints / checkpoint_name(2)).mkdir()
    run.quarantine.write_text("{not json")

    def export(_run: RunDir, checkpoint: str | None, target: Path) -> str:
        target.mkdir()
        return checkpoint or checkpoint_name(2)

    result = CliRunner().invoke(serve_command(export), [str(run.path)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.output.startswith(f"jobgen serve: {run.quarantine} is not a quarantine record"), result.output
    assert sbatch_calls == [] and not run.script("serve").exists()


def test_a_refused_sweep_lists_the_preflights_findings_too(tmp_path: Path, sbatch_calls, monkeypatch):
    """Every problem at once, as a run's refusal: not a second round for the cluster's."""
    path = small_sweep(tmp_path)
    path.write_text(path.read_text().replace('runs_root = "runs"', 'runs_root = "runs"\npass_env = ["JG_CORE_UNSET"]'))
    monkeypatch.delenv("JG_CORE_UNSET", raising=False)
    cluster = Finding("error", "job.partition", "no partition 'gpu' on this cluster")
    monkeypatch.setattr(executors, "preflight", lambda spec, script, options, quarantined: [cluster])
    with pytest.raises(SubmitError) as refused:
        submit_sweep(load_sweep(path), source_text=path.read_text())
    keys = [f.key for f in refused.value.findings if f.level == "error"]
    assert keys == ["job.pass_env", "job.pass_env", "job.partition"], refused.value.findings
    assert sbatch_calls == []


def test_sigterm_to_a_local_run_stops_its_job_as_slurm_would(tmp_path: Path):
    """The script gets the SIGTERM (its program saves and exits as planned) and jobgen waits
    for it, logging to the end: no job left running behind a jobgen that has gone."""
    spec_file = command_run(tmp_path)
    run = RunDir(tmp_path / "runs" / "core")
    out = (tmp_path / "out.txt").open("w")
    proc = subprocess.Popen(
        [str(VENV_BIN / "jobgen"), "submit", "--local", str(spec_file)],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its whole job in one group, killed at the end whatever happens
    )
    try:
        wait_for(lambda: (run.path / "started").exists(), 120, "the program to start", process=proc)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        assert (run.path / "stopped").exists(), (tmp_path / "out.txt").read_text()[-3000:]
        assert rc == 0 and "exited with status 0" in (tmp_path / "out.txt").read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        out.close()
