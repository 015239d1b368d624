"""The oldest torch jobgen's launch path is tested with, on the dev cluster: your own program
(``program = "command"``, examples' torch_loop.py) in a venv of its own with torch 2.8.0 (what
seed 004's fms-hf-tuning pins), whose torchrun has no ``--shutdown-timeout`` and refused jobgen's
launch line before (every array task exited 2 at once). Its first task meets its 2-minute time
limit, saves at the lead-time signal and stops; the second continues from that step.

The venv is built once per machine in ``~/.cache/jobgen-tests/torch-2.8.0`` (PyPI's torch 2.8.0
is its CUDA build, with its NVIDIA libraries: it runs on the CPU here; about 7 GB, a minute from
pip's cache), with jobgen's own dependencies; jobgen itself comes from the checkout, which the
batch script puts on PYTHONPATH.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import jobgen, paced, run_spec, submit, task_event, wait_for
from jobgen.base.exit_codes import ExitCode
from jobgen.base.paths import EXAMPLES_DIR

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

OLDEST_TORCH = "2.8.0"
CACHE = Path.home() / ".cache" / "jobgen-tests" / f"torch-{OLDEST_TORCH}"


@pytest.fixture(scope="session")
def old_torch_venv() -> Path:
    """A venv with torch OLDEST_TORCH and jobgen's dependencies, made once per machine."""
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with open(CACHE.parent / f"{CACHE.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one xdist worker builds it; the others wait
        done = CACHE / ".complete"
        if not done.exists():
            subprocess.run(["rm", "-rf", str(CACHE)], check=True)
            subprocess.run([sys.executable, "-m", "venv", str(CACHE)], check=True)
            pip = [str(CACHE / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            subprocess.run([*pip, f"torch=={OLDEST_TORCH}", "numpy"], check=True, timeout=1200)
            subprocess.run([*pip, "click>=8.1", "pydantic>=2.6", "jinja2>=3.1", "psutil>=5.9"], check=True)
            done.touch()
    return CACHE


def test_your_program_under_torch_2_8_goes_through_a_time_limit(cluster, tmp_path: Path, old_torch_venv: Path):
    version = subprocess.run(
        [old_torch_venv / "bin" / "python", "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert version.startswith(OLDEST_TORCH), version
    site = {"profile": "local", "python": {"kind": "venv", "venv": str(old_torch_venv)}}
    job = {"program": "command", "nodes": 1, "procs_per_node": 2, "time": "2m", "exit_grace": "50s", "array": 2}
    spec = run_spec(
        tmp_path,
        "old-torch",
        site=site,
        job={**job, "runs_root": str(tmp_path / "runs")},
        command={"script": str(EXAMPLES_DIR / "torch_loop.py"), "args": ["--steps", "100000"], "stop_signal": "none"},
        env=paced(),
    )
    checked = jobgen("validate", str(spec), check=True)
    assert f"torch {OLDEST_TORCH}" in checked.stdout + checked.stderr  # its torchrun's 30 s after SIGTERM, said
    submit(spec)
    run = tmp_path / "runs" / "old-torch"
    limited = wait_for(lambda: task_event(run, 1, "exit"), 240, "task 1 to meet its time limit")
    assert limited["exit_code"] in (ExitCode.SIGNALLED, ExitCode.DEADLINE), limited
    assert limited["exit_reason"].startswith("time limit"), limited
    saved = limited["end_step"]
    assert (run / "checkpoints" / f"step-{saved:08d}.pt").is_file()
    resumed = wait_for(lambda: task_event(run, 2, "first_step"), 150, "task 2 to take a step")
    assert resumed["start_step"] == saved and resumed["step"] == saved + 1, resumed
    (run / "switches" / "kill").touch()
