"""How torchrun's agent ends when SIGTERM reaches it while it closes its workers: the way the
surviving node's agent is ended when another node dies (srun's --kill-on-bad-exit). Two agents on
this machine as two nodes of a c10d rendezvous, each with one worker that saves for a few seconds
after its SIGTERM; the rendezvous host's agent is SIGKILLed, the other agent closes its worker
(its store is gone) and is SIGTERMed during that close.

torch's own torchrun (the control) never ends: its --tee threads are never stopped, and the
interpreter waits for them at exit, so on a cluster the step lives on until Slurm's KillWait.
Through jobgen.runtime.torchrun, as the batch script starts it, the agent ends once its worker
has saved, and SIGKILLs a worker that outlives the grace.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import REPO, VENV_BIN

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

SAVE_SECONDS = 5
# A worker that, after its SIGTERM, saves for SAVE_SECONDS and exits; or ("deaf") ignores it.
WORKER = textwrap.dedent(
    f"""
    import os, signal, sys, time
    open(os.path.join(sys.argv[1], f"worker-{{os.environ['RANK']}}.pid"), "w").write(str(os.getpid()))
    stop = []
    signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "deaf" else lambda *a: stop.append(1))
    print("ready", flush=True)
    while not stop:
        time.sleep(0.05)
    print("saving", flush=True)
    time.sleep({SAVE_SECONDS})
    print("saved", flush=True)
    """
)
SHIM = [sys.executable, "-m", "jobgen.runtime.torchrun"]
TORCHRUN = [str(VENV_BIN / "torchrun")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


class TwoNodes:
    """Two agents of one rendezvous (node 0 hosts its store), their workers and their outputs."""

    def __init__(self, launcher: list[str], tmp_path: Path, worker_mode: str, grace: int) -> None:
        self.dir = tmp_path
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(grace)}
        self.agents: list[subprocess.Popen] = []
        for node in (0, 1):
            cmd = [*launcher, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-id=exit"]
            cmd += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf=is_host={1 - node}", "--local-addr=127.0.0.1"]
            cmd += ["--max-restarts=0", f"--log-dir={tmp_path / f'logs{node}'}", "--tee=3"]
            cmd += [str(script), str(tmp_path), worker_mode]
            out = (tmp_path / f"agent{node}.txt").open("w")
            self.agents.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT))

    def output(self, node: int) -> str:
        return (self.dir / f"agent{node}.txt").read_text(errors="replace")

    def worker(self, rank: int) -> int:
        return int((self.dir / f"worker-{rank}.pid").read_text())

    def interrupt_close(self) -> None:
        """SIGKILL node 0's agent; SIGTERM node 1's agent while it closes its worker."""
        wait_until(lambda: self.output(0).count("ready") + self.output(1).count("ready") == 2, 120, "both ready")
        self.agents[0].kill()
        wait_until(lambda: "closing signal SIGTERM" in self.output(1), 60, "node 1's agent closes its worker")
        wait_until(lambda: "saving" in self.output(1), 30, "node 1's worker starts saving")
        self.agents[1].send_signal(signal.SIGTERM)

    def clean_up(self) -> None:
        for agent in self.agents:
            agent.kill()
            agent.wait()
        for rank in (0, 1):
            try:
                os.kill(self.worker(rank), signal.SIGKILL)
            except (OSError, ValueError):
                pass


@pytest.fixture
def two_nodes(tmp_path):
    made: list[TwoNodes] = []

    def make(launcher: list[str], worker_mode: str = "saves", grace: int = 30) -> TwoNodes:
        made.append(TwoNodes(launcher, tmp_path, worker_mode, grace))
        return made[-1]

    yield make
    for nodes in made:
        nodes.clean_up()


def test_torchs_own_agent_outlives_its_workers_after_a_sigterm_in_its_close(two_nodes):
    # The control: proves the scenario reaches the defect the shim exists for. If torch stops
    # the tailers itself one day, this fails, and jobgen.runtime.torchrun may go.
    nodes = two_nodes(TORCHRUN)
    nodes.interrupt_close()
    wait_until(lambda: not alive(nodes.worker(1)), 60, "node 1's worker ends")
    time.sleep(SAVE_SECONDS + 5)
    assert nodes.agents[1].poll() is None, nodes.output(1)[-3000:]


def test_jobgens_torchrun_ends_once_the_worker_has_saved(two_nodes):
    nodes = two_nodes(SHIM)
    nodes.interrupt_close()
    code = nodes.agents[1].wait(timeout=60)
    out = nodes.output(1)
    assert code == 1, out[-3000:]
    assert "SignalException" in out, out[-3000:]
    # The worker had the rest of its grace: it saved before the agent ended, and nothing was killed.
    assert "[default0]:saved" in out, out[-3000:]
    assert not alive(nodes.worker(1))
    assert "SIGKILLed" not in out


def test_jobgens_torchrun_kills_a_worker_that_outlives_the_grace(two_nodes):
    nodes = two_nodes(SHIM, worker_mode="deaf", grace=3)
    wait_until(lambda: (nodes.dir / "worker-1.pid").exists(), 120, "node 1's worker starts")
    nodes.agents[0].kill()
    wait_until(lambda: "closing signal SIGTERM" in nodes.output(1), 60, "node 1's agent closes its worker")
    nodes.agents[1].send_signal(signal.SIGTERM)
    code = nodes.agents[1].wait(timeout=60)
    out = nodes.output(1)
    assert code == 1, out[-3000:]
    assert f"workers [{nodes.worker(1)}] outlived the agent's close and its grace: SIGKILLed" in out, out[-3000:]
    assert not alive(nodes.worker(1))
