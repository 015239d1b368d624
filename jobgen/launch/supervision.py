"""The batch script's hand-over to the job's supervisor (:mod:`jobgen.job`): the settings it is
given, built from the spec here (rendering stays pure: spec and site in, text out), and the
launch line it runs. The script writes the settings as JSON into a quoted heredoc, which no
shell expands; ``python -m jobgen.job --settings "$JOBGEN_SUPERVISOR"`` reads them back.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from jobgen.base.exit_codes import ExitCode
from jobgen.job.settings import RendezvousSettings, SupervisorSettings
from jobgen.runs.heartbeat import interval_for
from jobgen.spec.resolved import ResolvedSpec


def relaunch_codes(spec: ResolvedSpec) -> list[ExitCode]:
    """The launch's ends a relaunch inside the task may get past: a crash or a hang, and, while
    job.spare_nodes leaves enough usable nodes, a node failure (the relaunch trains without it)."""
    return [c for c in ExitCode if c.relaunches or (c is ExitCode.NODE_FAILURE and spec.run.job.spare_nodes)]


def hang_timeout(spec: ResolvedSpec) -> int | None:
    """train.hang_timeout where the supervisor watches for hangs: a task that relaunches the
    trainer, whose ranks keep the heartbeats (your own program keeps none)."""
    if not (spec.in_job_restarts and spec.run.job.kind.trains):
        return None
    return spec.run.train.effective_hang_timeout


def supervisor_settings(spec: ResolvedSpec, forward_signal: str | None, container: list[str]) -> SupervisorSettings:
    job, net = spec.run.job, spec.site.network
    timeout = hang_timeout(spec)
    return SupervisorSettings(
        run_dir=str(spec.run_dir),
        lifecycle=job.resumable,
        command_plan=job.kind.planned,
        lead_signal=spec.site.slurm.signal,
        forward_signal=forward_signal,
        exit_grace=job.exit_grace,
        in_job_restarts=spec.in_job_restarts,
        relaunch_codes=[int(code) for code in relaunch_codes(spec)],
        hang_timeout=timeout,
        heartbeat_every=interval_for(timeout) if timeout else None,
        nodes=job.nodes,
        spare_nodes=job.spare_nodes,
        job_wide_gpus=bool(spec.site.slurm.gpus_per_node) and job.unequal_nodes,
        container=container,
        rendezvous=RendezvousSettings(
            port=net.rdzv_port,
            port_spread=net.rdzv_port_spread or 0,
            ifname=net.ifname if net.resolve_head_ip else None,
        ),
    )


def supervision_context(spec: ResolvedSpec, forward_signal: str | None, container: list[str]) -> dict[str, Any]:
    """What ``_launch.j2`` needs to hand the task over: the settings as JSON, and the container
    words of the launch line (shell words, quoted)."""
    settings = supervisor_settings(spec, forward_signal, container)
    return {
        "supervisor_settings": json.dumps(settings.model_dump(mode="json"), indent=2),
        "srun_container": "".join(f"{shlex.quote(arg)} " for arg in container),
    }
