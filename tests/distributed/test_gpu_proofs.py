"""bench/gpu_proofs.sh cannot rot between the rare sessions that have a GPU: its smoke mode
runs every part's script end to end on the CPU (tiny shapes, the real trainer under torchrun),
and the environment it makes on a bare GPU machine is made here from this machine's Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.torch

PARTS = ["7b", "mfu", "offload", "samples"]


def proofs(*args: str, env: dict[str, str] | None = None, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_proofs.sh"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        check=False,
    )


def test_smoke_runs_every_part_and_prints_one_table(tmp_path):
    proc = proofs("--smoke", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "gpu_proofs.json").read_text())
    assert [p["part"] for p in report["parts"]] == PARTS
    for part in report["parts"]:
        assert part["status"] == "ok", part
        assert part["figures"], part  # each script wrote its figures, not just an exit status
        assert (tmp_path / "out" / f"{part['part']}.log").stat().st_size > 0
    assert report["parts"][0]["figures"]["steps"] == 2  # the 7B script's trainer ran every step
    assert report["parts"][1]["figures"]["ratio"] > 0  # jobgen and the HF baseline both trained
    table = proc.stdout[proc.stdout.index("| part |") :]
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + len(PARTS)


def test_the_environment_for_a_bare_gpu_machine_runs_jobgen_and_torchrun(tmp_path):
    """What the script makes where only an image's Python exists: a venv whose bin/ holds the
    jobgen and torchrun the benchmarks launch, seeing the image's packages and this checkout;
    then the driver, which says there is no GPU here."""
    venv = tmp_path / "venv"
    proc = proofs("--work", str(tmp_path / "work"), env={"PYTHON": sys.executable, "JOBGEN_PROOFS_VENV": str(venv)})
    assert proc.returncode == 1 and "no GPU here" in proc.stdout, proc.stdout + proc.stderr
    version = subprocess.run([venv / "bin" / "jobgen", "--version"], capture_output=True, text=True, check=False)
    assert version.returncode == 0 and "jobgen" in version.stdout, version.stderr
    code = "import sys, trainer, torch.distributed.run; print(trainer.__file__)"
    found = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True, check=False)
    assert found.returncode == 0 and Path(found.stdout.strip()).is_relative_to(REPO), found.stderr
    usage = subprocess.run([venv / "bin" / "torchrun", "--help"], capture_output=True, text=True, check=False)
    assert usage.returncode == 0 and "--nproc-per-node" in usage.stdout, usage.stderr
