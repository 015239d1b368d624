"""Secrets stay off disk: a credential-looking name with a literal value in [env] (or a site's
env) is refused by validate, and job.pass_env hands such variables from the submitting shell
to the job without jobgen writing their values anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import jobgen, run_spec, spec_issues, write_spec
from jobgen.spec.loader import load_run

TOKEN = "hf_jobgen_test_value_0123456789"


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "MY_PASSWORD", "AWS_SECRET_ACCESS_KEY"])
def test_a_literal_secret_in_env_is_refused_with_its_name(tmp_path: Path, name: str):
    spec = run_spec(tmp_path, "s", job={"program": "doctor", "time": "10m"}, env={name: "x", "OMP_NUM_THREADS": "2"})
    found = spec_issues(spec)
    assert f"{name} looks like a secret" in found["env"] and "job.pass_env" in found["env"], found


def test_a_literal_secret_in_a_site_profiles_env_is_refused(tmp_path: Path):
    spec = run_spec(
        tmp_path, "s", site={"profile": "local", "env": {"HF_TOKEN": "x"}}, job={"program": "doctor", "time": "10m"}
    )
    found = spec_issues(spec)
    assert "HF_TOKEN looks like a secret" in found.get("site.env", ""), found


def test_settings_that_only_contain_the_letters_are_fine(tmp_path: Path):
    env = {"TOKENIZERS_PARALLELISM": "false", "NCCL_IB_HCA": "mlx5", "MONKEY_PATCH": "1"}
    spec = load_run(run_spec(tmp_path, "s", job={"program": "doctor", "time": "10m"}, env=env))
    assert spec.run.env == env


@pytest.mark.torch
def test_pass_env_reaches_the_job_and_no_file_of_the_run_holds_its_value(tmp_path: Path):
    (tmp_path / "show.py").write_text(
        "import os\nfrom jobgen import runtime\n"
        "open(runtime.current().run_dir / 'seen', 'w').write(str(os.environ.get('JG_TEST_TOKEN') == "
        f"{TOKEN!r}))\n"
    )
    spec = write_spec(
        tmp_path,
        f"""
        site = "local"
        [job]
        name = "secret"
        program = "command"
        time = "5m"
        exit_grace = "1m"
        runs_root = "{tmp_path / "runs"}"
        pass_env = ["JG_TEST_TOKEN"]
        [command]
        script = "show.py"
        """,
    )
    env = {k: v for k, v in os.environ.items() if k != "JG_TEST_TOKEN"}
    missing = jobgen("submit", "--local", str(spec), env={"JG_TEST_TOKEN": ""})
    assert missing.returncode == 2 and "job.pass_env" in missing.stderr and "JG_TEST_TOKEN" in missing.stderr
    assert not (tmp_path / "runs" / "secret").exists()  # refused before anything was written

    proc = jobgen("submit", "--local", str(spec), env={**env, "JG_TEST_TOKEN": TOKEN})
    run = tmp_path / "runs" / "secret"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run / "seen").read_text() == "True"  # the job had it
    for path in run.rglob("*"):  # and no file of the run holds it (env.txt names it at most)
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
