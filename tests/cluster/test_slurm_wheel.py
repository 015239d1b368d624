"""jobgen as a user installs it, on the dev cluster: the wheel built from this checkout,
installed (not editable) into a new venv outside the checkout, run from a temporary directory
with no checkout on any path. ``jobgen example`` writes the example, ``site init`` describes the
cluster, ``make-tiny-model`` builds the model from the package's own data, ``validate`` and
``render`` take the written profile by name, and a 2-node ``submit`` finishes in the new venv
(python.kind = "auto": the environment that submitted, activated on every node).

The new venv gets its dependencies from the test environment through a ``.pth`` line (nothing
is downloaded, torch is not installed twice); its own site-packages comes first, so jobgen,
trainer and watchdogs are the wheel's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from helpers import REPO, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

# What a checkout has at its top that a wheel must not need (examples/: what the quickstart wrote).
NOT_SOURCE = {".git", ".venv", "build", "dist", "jobgen.egg-info", "runs", "examples", ".pytest_cache"}


def not_source(directory: str, names: list[str]) -> set[str]:
    top = Path(directory) == REPO
    return {name for name in names if (top and name in NOT_SOURCE) or name == "__pycache__"}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv holding jobgen's wheel, built from a copy of the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=not_source)
    dist = root / "dist"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, source], check=True)
    (wheel,) = dist.glob("jobgen-*.whl")
    env = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True)
    subprocess.run([*pip, "--python", env / "bin" / "python", "install", "-q", "--no-deps", wheel], check=True)
    (site,) = env.glob("lib/python3*/site-packages")
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # torch's console script as pip writes it when it installs torch into this venv.
    torchrun = env / "bin" / "torchrun"
    torchrun.write_text(f"#!{env / 'bin' / 'python'}\nfrom torch.distributed.run import main\nmain()\n")
    torchrun.chmod(0o755)
    return env


def user_env(home: Path) -> dict[str, str]:
    """A user's shell: the new venv first on PATH, no checkout on PYTHONPATH, their own HOME."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "JOBGEN_SITE_PATH")}
    return {**env, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}


def test_the_wheel_runs_a_two_node_job_from_anywhere(venv: Path, cluster, tmp_path: Path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = user_env(home)
    jobgen = str(venv / "bin" / "jobgen")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([jobgen, *args], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert not check or proc.returncode == 0, f"jobgen {' '.join(args)}: {proc.stdout}{proc.stderr}"
        return proc

    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import jobgen, jobgen.base.paths as p; print(jobgen.__file__, p.CHECKOUT)"],
        cwd=work, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(venv)) and where.split()[1] == "None", where

    run("example", "sft", "sft", "--site", "devtest")
    runs = tmp_path / "runs"
    run("site", "init", "devtest", "--runs-root", str(runs), "--ifname", "eth0", "--no-gpu-compute")
    profile = (home / ".config" / "jobgen" / "sites" / "devtest.toml").read_text()
    assert (
        f'partition = "{cluster.default_partition}"' in profile
        and f"cpus_per_node = {cluster.cpus_per_node}" in profile
    )
    assert (
        f"gpus_per_node = {max(cluster.gpus.values())}" in profile
        and f'memory = "{cluster.mem_per_node_mb}M"' in profile
    )

    run("make-tiny-model", "sft/tiny-model")
    spec = work / "sft" / "sft.toml"
    text = spec.read_text()
    for key, value in (("max_steps", 6), ("save_every_steps", 3), ("every_steps", 3), ("array", 1)):
        text = re.sub(rf"^{key} = \d+", f"{key} = {value}", text, flags=re.MULTILINE)
    spec.write_text(text)

    assert "site 'devtest'" in run("validate", "sft/sft.toml").stdout
    script = run("render", "sft/sft.toml").stdout
    assert f"source {venv}/bin/activate" in script
    assert str(REPO) not in script and "git -C" not in script and "export PYTHONPATH" not in script

    run("submit", "sft/sft.toml")
    run_dir = runs / "tiny-sft"

    def finished() -> bool:
        state = json.loads(run("status", str(run_dir), "--json").stdout)
        assert state["state"] not in ("failed", "stopped"), state
        return state["state"] == "finished"

    wait_for(finished, 420, lambda: run("logs", str(run_dir), "--tail", "40", check=False).stdout)
    # The job's record of its environment: jobgen from the wheel, not the checkout.
    freeze = next((run_dir / "repro").glob("*/pip-freeze.txt")).read_text()
    assert re.search(r"^jobgen @ file://\S+/jobgen-[\d.]+-py3-none-any\.whl$", freeze, re.MULTILINE), freeze
