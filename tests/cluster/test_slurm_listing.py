"""A listing asks Slurm once for all its runs (issue 33): ``jobgen status`` of a runs root and
``jobgen compare`` of several runs make one ``squeue``, one ``scontrol show config`` and at most
one call about ended jobs (``sacct``, or without accounting one ``scontrol show job``), however
many runs they list. A team's runs root holds hundreds of runs; one call each took half a minute.

Counted at the client's one entry point (jobgen.slurm.client.run) while the dev cluster answers;
the runs' submissions are real jobs that ran and ended, so Slurm has something to tell of each.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import wait_for, write_spec
from jobgen.cli.main import main
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm
from jobgen.spec.loader import load_run

pytestmark = pytest.mark.slurm

RUNS = 5


def ended_jobs(names: list[str]) -> list[int]:
    """A job of each of these names that ran and ended, their ids (status knows a run's jobs
    by the run's name)."""
    submit = ["sbatch", "--parsable", "--wrap", "true", "--output", "/dev/null"]
    ids = [int(slurm.run([*submit, f"--job-name={name}"]).stdout.split(";")[0]) for name in names]
    wait_for(lambda: not slurm.queue(ids), 120, "the jobs to end")
    return ids


def recorded_run(directory: Path, root: Path, name: str, job_id: int) -> RunDir:
    """A run directory whose one submission is ``job_id``, with no record of its own of how
    it ended: only Slurm can tell."""
    body = f"""
        site = "local"
        [job]
        name = "{name}"
        time = "10m"
        runs_root = "{root}"
        program = "doctor"
    """
    spec = load_run(write_spec(directory, body, name=f"{name}.toml"))
    run = RunDir(spec.run_dir)
    run.path.mkdir(parents=True)
    run.spec_file.write_text(json.dumps(spec.to_json()))
    run.record_job({"job_id": job_id})
    return run


def counted_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    calls: Counter = Counter()
    original = slurm.run

    def counting(argv: list[str], *args, **kwargs):
        calls[" ".join(argv[:3]) if argv[0] == "scontrol" else argv[0]] += 1
        return original(argv, *args, **kwargs)

    monkeypatch.setattr(slurm, "run", counting)
    return calls


def test_status_and_compare_of_many_runs_ask_slurm_once(cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "runs"
    names = [f"r{i}" for i in range(RUNS)]
    ids = ended_jobs(names)
    runs = [recorded_run(tmp_path, root, name, job) for name, job in zip(names, ids, strict=True)]
    monkeypatch.setenv("JOBGEN_RUNS_ROOT", str(root))
    accounting = slurm.accounting_enabled(slurm.config())
    # sacct knows a job once slurmdbd has its end and its name (just after, it may still say
    # RUNNING, or name the job "allocation"): wait until it has all of them, as a later look would.
    if accounting:
        wait_for(
            lambda: (
                {(r.job_id, r.name, r.state) for r in slurm.ended_jobs(ids, accounting=True)}
                >= {(job, name, "COMPLETED") for job, name in zip(ids, names, strict=True)}
            ),
            60,
            "sacct to know how every job ended",
        )

    calls = counted_calls(monkeypatch)
    listed = CliRunner().invoke(main, ["status", "--json"])
    assert listed.exit_code == 0, listed.output
    statuses = json.loads(listed.output)
    assert sorted(s["name"] for s in statuses) == names
    # Slurm told each run how its job ended: the listing shows it, from the one call.
    for status in statuses:
        assert [t["state"] for t in status["tasks"]] == ["COMPLETED"], status["tasks"]
    assert calls["squeue"] == 1 and calls["scontrol show config"] == 1, calls
    ended = "sacct" if accounting else "scontrol show job"
    assert calls[ended] == 1 and sum(calls.values()) == 3, calls

    calls.clear()
    compared = CliRunner().invoke(main, ["compare", *(str(r.path) for r in runs), "--json"])
    assert compared.exit_code == 0, compared.output
    assert calls["squeue"] == 1 and calls[ended] == 1 and sum(calls.values()) == 3, calls
