"""What the batch script tells its supervisor: the spec's decisions about the task, rendered by
:func:`jobgen.launch.supervision.supervisor_settings` into the script as JSON (``jobgen.job
--settings``), and the task's own facts, from the Slurm environment it runs in.

A script stays queued for days and then runs under whatever jobgen is installed: the settings
carry a version, and a later jobgen reads every version it ever wrote.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from jobgen.spec.fields import StrictModel


class RendezvousSettings(StrictModel):
    """Where a launch's rendezvous is, once the supervisor has chosen its nodes."""

    port: int = Field(description="network.rdzv_port: the store's port on the launch's first node.")
    port_spread: int = Field(
        0, description="network.rdzv_port_spread: jobs sharing a head node add job id mod this (0: none)."
    )
    ifname: str | None = Field(
        None, description="network.ifname where network.resolve_head_ip asks the head node its own address."
    )


class SupervisorSettings(StrictModel):
    """The task's settings, as the rendered batch script passes them to ``python -m jobgen.job``."""

    version: Literal[1] = Field(1, description="The settings' format: a later jobgen still reads this one.")
    run_dir: str = Field(description="The run directory (RunDir): records, markers, switches and logs.")
    lifecycle: bool = Field(
        description="The program leaves jobgen's exit records and markers (the bundled programs, jobgen.runtime)."
    )
    command_plan: bool = Field(
        description='Your own program ([job] program = "command"): its plan is written again before each '
        "relaunch, and an exit 0 of its own finishes the run."
    )
    lead_signal: str = Field(description="slurm.signal: the signal Slurm sends the batch step before the time limit.")
    forward_signal: str | None = Field(
        None, description="[command] stop_signal: passed on to your own program when the lead-time signal comes."
    )
    exit_grace: int = Field(description="job.exit_grace: seconds before the limit when no relaunch starts.")
    in_job_restarts: int = Field(0, description="job.in_job_restarts: relaunches inside one task at most.")
    relaunch_codes: list[int] = Field(
        default_factory=list, description="jobgen's exit codes a relaunch may get past (a crash, a hang, ...)."
    )
    hang_timeout: int | None = Field(None, description="train.hang_timeout where the supervisor watches heartbeats.")
    heartbeat_every: int | None = Field(None, description="How often the ranks beat and the supervisor looks.")
    nodes: int = Field(description="job.nodes: the nodes each launch trains on.")
    spare_nodes: int = Field(0, description="job.spare_nodes: allocated beyond job.nodes, to relaunch around a loss.")
    job_wide_gpus: bool = Field(
        False, description="The job's GPUs are one count for all nodes (--gpus): helper steps ask --gpus=0."
    )
    container: list[str] = Field(
        default_factory=list, description="srun's container options for helper steps (pyxis), as for the launch."
    )
    rendezvous: RendezvousSettings = Field(description="The launch's rendezvous, moved to its first node.")


@dataclass(frozen=True)
class Task:
    """This task as Slurm's environment names it (``jobgen submit --local`` sets the same names)."""

    job_id: str
    array_job_id: str | None
    array_task: str | None
    restart: int
    nodelist: str
    num_nodes: int
    job_start: int
    on_slurm: bool
    head_node: str
    rdzv_endpoint: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Task:
        env = os.environ if env is None else env
        restart = env.get("SLURM_RESTART_COUNT") or "0"
        start = env.get("JOBGEN_JOB_START") or ""
        return cls(
            job_id=env.get("SLURM_JOB_ID") or "",
            array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
            array_task=env.get("SLURM_ARRAY_TASK_ID") or None,
            restart=int(restart) if restart.isdecimal() else 0,
            nodelist=env.get("SLURM_JOB_NODELIST") or "",
            num_nodes=int(env.get("SLURM_JOB_NUM_NODES") or 1),
            job_start=int(start) if start.isdecimal() else int(time.time()),
            on_slurm=env.get("JOBGEN_LOCAL", "0") != "1",
            head_node=env.get("JOBGEN_HEAD_NODE") or "",
            rdzv_endpoint=env.get("JOBGEN_RDZV_ENDPOINT") or "",
        )

    @property
    def slurm_name(self) -> str:
        """This array task as scontrol and scancel must name it (ARRAYID_TASK): Slurm 22.05 ignores
        scancel of a task's own id, and the last task's own id is the array's, which names them all."""
        if self.array_job_id and self.array_task:
            return f"{self.array_job_id}_{self.array_task}"
        return self.job_id
