"""Everything the supervisor does to the world, behind one small interface: Slurm (through
:mod:`jobgen.slurm.client`) for a task on a cluster, the local machine for ``jobgen submit
--local``. The dev-cluster scenarios exercise :class:`SlurmEffects`; the decisions that call
these are tested without them (:mod:`jobgen.job.decisions`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from jobgen.base.atomic import write_text_atomic
from jobgen.job.settings import SupervisorSettings, Task
from jobgen.runs import quarantine
from jobgen.runs.rundir import RunDir
from jobgen.slurm import client as slurm

# Helper steps on the batch host's allocation: never wait long for one.
HELPER_TIMEOUT = 120
SNAPSHOT_CLEANUP_TIMEOUT = 60
REMOVE_SNAPSHOTS = 'rm -rf "$1"; rmdir "${1%/*}" 2>/dev/null || true'
HEAD_ADDRESS = 'ip -4 -o addr show dev "$1" | awk \'{split($4, a, "/"); print a[1]; exit}\''


class LocalEffects:
    """``jobgen submit --local``: one machine, no Slurm; the launch is the node script itself."""

    on_slurm = False

    def __init__(self, settings: SupervisorSettings, task: Task, run: RunDir):
        self.settings, self.task, self.run = settings, task, run

    def start_launch(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["bash", "-c", env["NODE_LAUNCH"]], env=env)

    def seconds_to_limit(self) -> int | None:
        return None

    def set_comment(self, words: str) -> None:
        return None

    def forward(self, name: str, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.Signals[f"SIG{name}"])

    def take_stacks(self, nodes: list[str]) -> str:
        proc = subprocess.run(
            ["python", "-m", "jobgen.runtime.stacks", self.task.job_id],
            capture_output=True, text=True, timeout=HELPER_TIMEOUT, check=False,
        )  # fmt: skip
        return proc.stdout + proc.stderr

    def kill_launch(self, proc: subprocess.Popen[bytes], launch: int, *, node_lost: bool = False) -> str | None:
        _kill_tree(proc)
        return None

    def nodes_at_fault(self, launch: int, nodes: list[str]) -> str:
        return ""

    def launch_nodes(self, count: int) -> list[str]:
        return [self.task.nodelist]

    def head_address(self, node: str) -> str:
        return node

    def clear_snapshots(self, directory: str) -> str | None:
        subprocess.run(["bash", "-c", REMOVE_SNAPSHOTS, "_", directory], check=False)
        return None

    def cancel_pending(self, words: str) -> list[str]:
        return []

    def slurmd_addresses(self, nodes: list[str]) -> dict[str, tuple[str, int]]:
        return {}

    def node_answers(self, address: tuple[str, int]) -> bool:
        return True

    def quarantine_lost(self, found: dict[str, str]) -> str:
        return ""


class SlurmEffects(LocalEffects):
    """A task on a Slurm cluster: helper steps overlap the launch's (``--overlap``: a launch that
    lost a node leaves its step holding the CPUs of the nodes that live, Slurm 22.05 with --no-kill)."""

    on_slurm = True

    def __init__(self, settings: SupervisorSettings, task: Task, run: RunDir):
        super().__init__(settings, task, run)
        self.cancels: list[subprocess.Popen[bytes]] = []  # scancels waiting for a dead node, reaped as they end

    def start_launch(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        if self.settings.container and not any(env.get(v) for v in ("JOBGEN_JOB_END_TIME", "SLURM_JOB_END_TIME")):
            # An image holds no squeue for rank 0 to ask when the job ends (Slurm 22.05 sets no
            # variable for it): the deadline is asked here, on the batch host, and handed in.
            end = slurm.end_time(self.task.job_id)
            env = {**env, "JOBGEN_JOB_END_TIME": str(int(end))} if end is not None else env
        return subprocess.Popen(["bash", "-c", env["JOBGEN_SRUN_LAUNCH"]], env=env)

    def _helper(self, nodes: list[str], command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        count = len(nodes)
        args = [
            "srun",
            f"--jobid={self.task.job_id}",
            "--overlap",
            f"--nodes={count}",
            f"--ntasks={count}",
            "--ntasks-per-node=1",
        ]
        args += [f"--nodelist={','.join(nodes)}", "--cpus-per-task=1", "--mem=0", "--quiet", "--kill-on-bad-exit=0"]
        args += ["--gpus=0"] if self.settings.job_wide_gpus else []
        return slurm.run([*args, *command], timeout=timeout, check=False)

    def seconds_to_limit(self) -> int | None:
        end = slurm.end_time(self.task.job_id)
        return None if end is None else int(end - time.time())

    def set_comment(self, words: str) -> None:
        # Slurm refuses to change it once the job is past its time limit: the lead-time signal sets one first.
        try:
            slurm.update_job(self.task.slurm_name, Comment=f"jobgen: {words}")
        except (OSError, slurm.SlurmError):
            print(f"jobgen: could not set the job's comment (scontrol update JobId={self.task.slurm_name})", flush=True)

    def forward(self, name: str, proc: subprocess.Popen[bytes] | None) -> None:
        slurm.cancel(self.task.slurm_name, signal=name)

    def take_stacks(self, nodes: list[str]) -> str:
        command = [*self.settings.container, "python", "-m", "jobgen.runtime.stacks", self.task.job_id]
        proc = self._helper(nodes, ["--job-name=jobgen-hang-stacks", *command], HELPER_TIMEOUT)
        return proc.stdout + proc.stderr

    def kill_launch(self, proc: subprocess.Popen[bytes], launch: int, *, node_lost: bool = False) -> str | None:
        """Kill the launch's step by its name: every rank on every node at once, where killing srun
        would leave a node that no longer answers holding its ranks. ``node_lost``: scancel is left
        to wait for the dead node on its own, while the supervisor's wait for the launch goes on."""
        name = f"jobgen-launch-{launch}"
        step = next((step for step, named in slurm.steps(self.task.job_id).items() if named == name), None)
        if step is None:
            _kill_tree(proc)
            return "could not find this launch's step (squeue --steps): killed srun"
        try:
            if node_lost:
                self.cancels = [c for c in self.cancels if c.poll() is None] + [
                    slurm.cancel_in_background(step, signal="KILL")
                ]
            else:
                slurm.cancel(step, signal="KILL")
        except (OSError, slurm.SlurmError):
            _kill_tree(proc)
            return f"could not kill step {step} (scancel): killed srun"
        return None

    def nodes_at_fault(self, launch: int, nodes: list[str]) -> str:
        found = quarantine.after_task(self.run, self.task.job_id, str(self.task.restart), ",".join(nodes), launch)
        return quarantine.summary(found)

    def launch_nodes(self, count: int) -> list[str]:
        return quarantine.launch_nodes(self.run, self.task.job_id, count)

    def head_address(self, node: str) -> str:
        ifname = self.settings.rendezvous.ifname
        if not ifname:
            return node
        # On the node's host, as the batch script's first address: a container on the node's network
        # has the same interfaces, and an image started only for `ip` could outlast the 60 s.
        proc = self._helper([node], ["bash", "-c", HEAD_ADDRESS, "_", ifname], 60)
        return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""

    def clear_snapshots(self, directory: str) -> str | None:
        """On every node the job holds now (one it lost is no longer in it)."""
        held = slurm.held_nodes(self.task.job_id) or self.task.nodelist
        try:
            nodes = slurm.hostnames(held)
        except slurm.SlurmError:
            nodes = []
        proc = self._helper(nodes, ["bash", "-c", REMOVE_SNAPSHOTS, "_", directory], SNAPSHOT_CLEANUP_TIMEOUT)
        return (
            None
            if nodes and proc.returncode == 0
            else f"could not delete the memory snapshots ({directory}) on every node"
        )

    def cancel_pending(self, words: str) -> list[str]:
        """The array's tasks still pending, cancelled with the reason as their comment: a run that
        is finished or failed has nothing for them to do but take the nodes from the queue."""
        if not self.task.array_job_id:
            return []
        pending = slurm.pending_tasks(self.task.array_job_id)
        if pending:
            try:
                # One update names every task of the array (a task updated alone would be split off
                # into a record of its own); this task's own comment is set after.
                slurm.update_job(self.task.array_job_id, Comment=f"jobgen: cancelled: {words}")
            except slurm.SlurmError:
                pass  # the comment is for people; the cancel is what matters
            slurm.cancel(self.task.array_job_id, pending_only=True)
        return pending

    def slurmd_addresses(self, nodes: list[str]) -> dict[str, tuple[str, int]]:
        return slurm.slurmd_addresses(nodes)

    def node_answers(self, address: tuple[str, int]) -> bool:
        return slurm.slurmd_answers(address)

    def quarantine_lost(self, found: dict[str, str]) -> str:
        return quarantine.summary(quarantine.lost(self.run, self.task.job_id, found))


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """The launcher and its children (off Slurm the node script's torchrun and its workers)."""
    try:
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False)
        for pid in children.stdout.split():
            os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass
    try:
        proc.kill()
    except OSError:
        pass


def keep_stacks(path: Path, text: str) -> None:
    """The stacks, into a new file renamed to its name: a link or a FIFO at the name is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
