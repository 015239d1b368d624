"""The launch inside a podman container ends when the ``podman run`` that Slurm tracks is
SIGKILLed (KillWait's end, or ``scancel --signal=KILL``): Slurm's SIGKILL does not reach the
container's processes, and without the tether they run on (the step with them, on the dev
cluster, until they end). jobgen's torchrun is started as the podman step starts it
(``JOBGEN_TETHER_PID`` naming a stand-in for ``podman run``); the stand-in is SIGKILLed; the
worker, which would take its time over a SIGTERM, and the agent are SIGKILLed at once, as
Slurm's SIGKILL would have done. The control, the same launch untethered, is still running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = [pytest.mark.torch, pytest.mark.timeout(240)]

WORKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: print("SIGTERM: saving for a minute", flush=True) or time.sleep(60))
open(sys.argv[1], "w").write(str(os.getpid()))
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def launch(tmp_path: Path, name: str, tether: int | None) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "20"}
    env.pop("JOBGEN_TETHER_PID", None)
    if tether is not None:
        env["JOBGEN_TETHER_PID"] = str(tether)
    argv = [sys.executable, "-m", "jobgen.runtime.torchrun", "--standalone", "--nproc-per-node=1"]
    argv += [f"--log-dir={tmp_path / name}", "--tee=3", str(script), str(tmp_path / f"{name}.pid")]
    out = (tmp_path / f"{name}.txt").open("w")
    return subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)


def wait_for_text(path: Path, text: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} in {path} within {seconds} s:\n{path.read_text()[-2000:]}"
        time.sleep(0.1)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:  # gone (and reaped)
        return False


def wait_gone(pid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while running(pid):
        assert time.monotonic() < deadline, f"worker {pid} still there after {seconds} s"
        time.sleep(0.1)


def test_a_launch_tethered_to_a_killed_podman_run_is_killed_with_its_worker(tmp_path):
    podman_run = subprocess.Popen(["sleep", "600"])  # what srun tracks: `podman run`
    tethered = launch(tmp_path, "tethered", podman_run.pid)
    control = launch(tmp_path, "control", None)
    try:
        wait_for_text(tmp_path / "tethered.txt", "ready", 120)
        wait_for_text(tmp_path / "control.txt", "ready", 120)
        podman_run.kill()
        podman_run.wait()
        assert tethered.wait(30) == 128 + 9  # the agent, as a SIGKILL would have ended it
        worker = int((tmp_path / "tethered.pid").read_text())
        wait_gone(worker, 30)
        output = (tmp_path / "tethered.txt").read_text()
        assert "the step's podman run was killed: SIGKILLing the workers" in output, output[-3000:]
        assert "saving for a minute" not in output  # not a SIGTERM and its grace: Slurm's SIGKILL was
        # Untethered, the same launch goes on: what a container does after its step was SIGKILLed.
        assert control.poll() is None and running(int((tmp_path / "control.pid").read_text()))
    finally:
        for proc in (podman_run, tethered, control):
            proc.kill()
            proc.wait()
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / "worker.py")], check=False)  # the control's worker
