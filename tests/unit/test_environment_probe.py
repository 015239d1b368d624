"""The job's Python environment, checked before anything is queued (jobgen.launch.environment):
a module the run needs and the environment lacks is one error naming the jobgen extra that
installs it; the environment's torch decides what its torchrun is told, and the launch line
uses no option the oldest supported torchrun lacks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DATA, REPO, jobgen, run_spec
from jobgen.launch.environment import EnvironmentFacts, _facts_findings, probe, required_imports
from jobgen.launch.render import render
from jobgen.spec.loader import load_run

# torchrun's options in torch 2.5 (torch/distributed/run.py at v2.5.0), the oldest torch
# pyproject.toml admits: the launch line may use no other (torch 2.8's torchrun refused
# --shutdown-timeout and every array task failed at once).
TORCHRUN_2_5 = {
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
    "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--standalone", "--max-restarts",
    "--max_restarts", "--monitor-interval", "--start-method", "--role", "--module", "--no-python", "--run-path",
    "--log-dir", "--log_dir", "--redirects", "--tee", "--local-ranks-filter", "--node-rank", "--node_rank",
    "--master-addr", "--master-port", "--local-addr", "--local_addr", "--logs-specs",
}  # fmt: skip


def bare_venv(path: Path) -> Path:
    """A venv with nothing installed (no pip: a second or two)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def old_torch(venv: Path, version: str) -> None:
    """A stand-in torch of ``version`` whose launcher does not read TORCH_ELASTIC_SHUTDOWN_TIMEOUT."""
    root = site_packages(venv)
    (root / "torch" / "distributed" / "launcher").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("")
    (root / "torch" / "distributed" / "launcher" / "api.py").write_text("# shutdown after 30 s\n")
    meta = root / f"torch-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


def spec_in(tmp_path: Path, venv: Path | None, **train: object) -> Path:
    site: dict[str, object] = {"profile": "local"}
    if venv is not None:
        site["python"] = {"kind": "venv", "venv": str(venv)}
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return run_spec(
        tmp_path,
        "env",
        site=site,
        job={"time": "10m", "exit_grace": "2m", "runs_root": str(tmp_path / "runs")},
        model={"path": str(model)},
        data={"path": str(DATA)},
        train={"max_steps": 2, **train},
    )


def test_an_environment_without_the_trainers_modules_is_refused_naming_the_extra(tmp_path: Path):
    venv = bare_venv(tmp_path / "venv")
    proc = jobgen("validate", str(spec_in(tmp_path, venv)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"the job's environment ({venv}) lacks torch, transformers, datasets, tokenizers, safetensors" in proc.stderr
    assert "pip install 'jobgen[train]'" in proc.stderr and "Traceback" not in proc.stderr
    # submit refuses it the same way, and writes no run directory
    proc = jobgen("submit", "--local", str(spec_in(tmp_path, venv)))
    assert proc.returncode != 0 and "jobgen[train]" in proc.stderr
    assert not (tmp_path / "runs" / "env").exists()


def test_the_extras_a_spec_asks_for_are_named(tmp_path: Path):
    spec = load_run(spec_in(tmp_path, None, report_to=["tensorboard", "wandb"]))
    needed = required_imports(spec)
    assert ("track", "tensorboard") in needed and ("track", "wandb") in needed and ("train", "torch") in needed
    facts = EnvironmentFacts("/env/bin/python", "3.11.7", ("wandb",), "2.13.0", "0.1.0", True)
    (finding,) = _facts_findings(spec, facts, needed)
    assert finding.level == "error" and "lacks wandb: pip install 'jobgen[track]'" in finding.message


def test_this_environment_answers_with_its_own_torch():
    import importlib.metadata

    facts = probe(sys.executable, ["torch", "no_such_module_here"])
    assert facts.missing == ("no_such_module_here",)
    assert facts.torch == importlib.metadata.version("torch") and facts.shutdown_timeout_env


def test_an_older_torch_is_found_and_its_stop_grace_said(tmp_path: Path):
    venv = bare_venv(tmp_path / "venv")
    old_torch(venv, "2.8.0")
    facts = probe(str(venv / "bin" / "python"), ["torch"])
    assert facts.torch == "2.8.0" and not facts.shutdown_timeout_env and facts.missing == ()
    spec = load_run(spec_in(tmp_path, venv))
    (finding,) = _facts_findings(spec, facts, [("train", "torch")])
    assert finding.key == "job.exit_grace" and "torch 2.8.0" in finding.message and "30 s" in finding.message


def test_an_interpreter_only_the_nodes_have_is_a_warning(tmp_path: Path):
    proc = jobgen("validate", str(spec_in(tmp_path, tmp_path / "nodes-only-venv")))
    assert proc.returncode == 0, proc.stderr
    assert "warning: site.python:" in proc.stderr and "is not on this machine" in proc.stderr


@pytest.mark.parametrize("spec_file", sorted((REPO / "tests" / "golden" / "specs").glob("*-train.toml")))
def test_the_launch_line_uses_only_options_the_oldest_torchrun_has(spec_file: Path):
    text = render(load_run(spec_file))
    launch = text[text.index("exec python -m jobgen.runtime.torchrun") :]
    launch = launch[: launch.index("\nNODE")]
    options = set(re.findall(r"^\s+(--[a-z][a-z_-]*)", launch, re.MULTILINE))
    assert options and options <= TORCHRUN_2_5, options - TORCHRUN_2_5
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=" in text  # the grace for SIGTERM, where torch reads it


def test_a_serve_jobs_environment_without_the_server_is_named(tmp_path: Path):
    """Issue 46: `jobgen serve --local` without [serve] ended in a transformers traceback, exit 3."""
    from jobgen.launch.environment import serve_environment_problem
    from jobgen.spec.tables.site import PythonSettings

    venv = bare_venv(tmp_path / "venv")
    problem = serve_environment_problem(PythonSettings(kind="venv", venv=str(venv)), here=False)
    assert problem == (
        f"the serve job's environment ({venv}) lacks torch, transformers, fastapi, uvicorn: "
        "pip install 'jobgen[train,serve]' into it"
    )
    assert serve_environment_problem(PythonSettings(kind="venv", venv=str(venv)), here=True) is None  # this one serves
    assert serve_environment_problem(PythonSettings(kind="modules", modules=["cuda"]), here=False) is None
