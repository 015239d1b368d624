"""The reproducibility record a job writes under ``repro/<jobid>/``: the rendered
snippet runs in bash against a hostile environment, and no secret reaches env.txt (the rule
that validates [env], jobgen.spec.env_names, decides there too)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import GOLDEN, REPO
from jobgen.launch.render import render
from jobgen.spec.loader import load_run

# Everything here lives in a run directory the team reads for months: values must not.
SECRETS = {
    "SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T0/B0/slacksecret1",
    "HTTPS_PROXY": "http://alice:proxypass2@proxy.example:3128",
    "my_api_key": "lowerkey3",
    "SMTP_PASS": "smtppass4",
    "DEPLOY_CERT": "-----BEGIN KEY-----\nmultisecret5\nNCCL_FAKE=injected\n-----END KEY-----",
    "HF_TOKEN": "hf_secret6",
    "HUGGING_FACE_HUB_TOKEN": "hf_secret7",
    "HF_ENDPOINT": "https://bob:endpointpass8@mirror.example",  # an allowed name, credentials in the value
    "NCCL_SECRET_SAUCE": "ncclsecret9",  # a secret inside an allowed prefix
    "torch_auth": "torchauth10",
    # Spellings without separators and credentials' other names, under allowed prefixes too.
    "HF_HUBTOKEN": "hubtoken11",
    "NCCL_PAT": "ncclpat12",
    "TORCH_DSN": "torchdsn13",
    "CUDA_MISC": "hf_" + "a" * 34 + "14",  # a Hugging Face token under an allowed name
}
ALLOWED = {
    "NCCL_DEBUG": "INFO",
    "SLURM_JOB_ID": "42",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "HF_HOME": "/shared/hf",
    "LD_LIBRARY_PATH": "/opt/cuda/lib64",
}


def repro_section(text: str) -> str:
    """The rendered reproducibility block, from its heading to the end of its brace group."""
    start = text.index("# --- Reproducibility record")
    end = text.index('} 2>"$REPRO_DIR/errors.txt"', start)
    return text[start : text.index("\n", end) + 1]


def record(script_text: str, env: dict[str, str], run_dir: Path) -> str:
    """Run the block in bash with exactly ``env``; the env.txt it wrote."""
    # The other records (git, pip, scontrol) need a job; only env.txt is under test: the job's
    # Python (this one) writes it from the environment bash pipes in.
    stubs = "\n".join(f"{name}() {{ cat >/dev/null; }}" for name in ("log", "node_names", "git", "scontrol"))
    python = f'py_on_head() {{ if [[ "$1" == python ]]; then shift; {sys.executable} "$@"; else cat >/dev/null; fi; }}'
    script = f"set -euo pipefail\n{stubs}\n{python}\non_slurm() {{ false; }}\n{repro_section(script_text)}"
    subprocess.run(
        ["bash", "-c", script], env={**env, "RUN_DIR": str(run_dir)}, check=True, stdin=subprocess.DEVNULL, timeout=60
    )
    return (run_dir / "repro" / env["SLURM_JOB_ID"] / "env.txt").read_text()


@pytest.mark.parametrize("stem", ["bare-train", "h100-ib-train"])
def test_env_record_keeps_secrets_out_of_the_run_directory(stem: str, tmp_path: Path):
    spec = load_run(GOLDEN / "specs" / f"{stem}.toml")
    allowed = {**ALLOWED, **{name: "set by the run's [env]" for name in spec.run.env}, "PATH": os.environ["PATH"]}
    out = record(render(spec), {**SECRETS, **allowed}, tmp_path)

    for name, value in SECRETS.items():
        secret = re.search(r"[a-z_]+\d+", value).group()  # each value's secret part
        assert secret in value and len(secret) > 5
        assert secret not in out, f"{name}'s value reached env.txt"
    lines = out.splitlines()
    for name, value in allowed.items():
        assert f"{name}={value}" in lines
    names = [line.split("=", 1)[0] for line in lines]
    assert set(SECRETS) <= set(names)  # named, so a reader knows they were set
    assert "NCCL_FAKE" not in names and len(names) == len(set(names))  # one line per variable


def test_allowed_values_with_newlines_stay_on_one_line(tmp_path: Path):
    env = {
        "PATH": os.environ["PATH"],
        "SLURM_JOB_ID": "7",
        "TORCH_LOGS": "+dynamo\nNCCL_DEBUG=forged",
        "NCCL_DEBUG": "WARN",
    }
    lines = record(render(load_run(GOLDEN / "specs" / "bare-train.toml")), env, tmp_path).splitlines()
    assert "TORCH_LOGS=$'+dynamo\\nNCCL_DEBUG=forged'" in lines
    assert [line for line in lines if line.startswith("NCCL_DEBUG=")] == ["NCCL_DEBUG=WARN"]


def test_versions_record_reads_the_installed_versions_without_importing_torch():
    """versions.json's torch and CUDA versions are torch's own, read without importing torch
    (every array task writes the record before its launch; the import cost about two
    CPU-seconds a task)."""
    probe = (
        "import json, sys\n"
        "from jobgen.launch.repro import installed_versions\n"
        "print(json.dumps({'info': installed_versions(), 'torch_imported': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    record = json.loads(out)
    assert record["torch_imported"] is False
    torch = pytest.importorskip("torch")
    info = record["info"]
    assert info["torch"] == torch.__version__ and info["cuda"] == torch.version.cuda
    assert info["python"] == sys.version.split()[0] and set(info) == {"python", "platform", "torch", "cuda", "nccl"}


def test_versions_record_parses_torch_version_file_without_running_it():
    from jobgen.launch.repro import _literal_assignment

    source = "import os\nos.system('false')\n__version__ = '2.9.0+cu128'\ncuda: Optional[str] = '12.8'\nhip = None\n"
    assert _literal_assignment(source, "cuda") == "12.8"
    assert _literal_assignment(source, "hip") is None
    assert _literal_assignment("cuda = compute()\n", "cuda") is None


def test_freeze_record_lists_what_pip_freeze_lists_without_pip(tmp_path: Path):
    """pip-freeze.txt from package metadata: the requirement lines of `pip freeze` (its
    comments aside, an editable install by its path), run from another directory as the batch
    script does."""
    pip = subprocess.run([sys.executable, "-m", "pip", "freeze"], cwd=tmp_path, capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip(f"no pip here to compare with: {pip.stderr.strip()[-200:]}")
    ours = subprocess.run(
        [sys.executable, "-m", "jobgen.launch.repro", "--freeze"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    requirements = [line for line in ours.stdout.splitlines() if not line.startswith("#")]
    pips = [line for line in pip.stdout.splitlines() if not line.startswith("#")]
    assert [line for line in requirements if not line.startswith("-e ")] == [
        line for line in pips if not line.startswith("-e ")
    ]
    # This checkout, installed editable: by its path (pip names a checkout with a remote by its
    # URL and commit instead; the record has the commit in git-commit.txt).
    assert [line for line in requirements if line.startswith("-e ")] == [f"-e {REPO}"]
    assert len([line for line in pips if line.startswith("-e ")]) == 1
