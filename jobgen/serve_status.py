"""Where a served model stands, and stopping its server: ``jobgen serve RUN --status | --stop``.

    jobgen serve RUN --status [--json]   # up (where, which job, which model), starting, pending, ended
    jobgen serve RUN --stop              # scancel the serve job; its address file goes

The state directory (the run, or the model directory served as it is) holds two records:
``serve-job.json``, written by ``jobgen serve`` when it starts a job, and ``serve.json``, the
address the job writes once the server answers (jobgen.serve_node). Slurm says whether the
job is still queued or running (through jobgen.slurm); a GET of ``/v1/models`` says whether
the server answers. Looking changes nothing: a stale ``serve.json`` (a job killed outright,
a lost node) is removed by ``--stop`` and by the next ``jobgen serve``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobgen import slurm
from jobgen.rundir import RunDir
from jobgen.serve_node import answers

# How long --stop waits for the job to leave the queue: Slurm's KillWait (30 s) and a margin.
STOP_WAIT_SECONDS = 60.0
POLL_SECONDS = 1.0
# Job states of a server that is not there yet, or still there.
STATES_ACTIVE = ("pending", "starting", "up", "not answering", "stopping", "unknown")


class ServeStateError(RuntimeError):
    """A serve record cannot be read, or the server cannot be reached; the message says which."""


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ServeStateError(f"{path} is unreadable: {exc}") from None
    return value if isinstance(value, dict) else None


def read_job(state: RunDir) -> dict[str, Any] | None:
    """serve-job.json: the serve job `jobgen serve` started last."""
    job = _read(state.serve_job)
    if job is not None and not str(job.get("job_id", "")).isdigit():
        raise ServeStateError(f"{state.serve_job} names no job id: {job}")
    return job


def read_address(state: RunDir) -> dict[str, Any] | None:
    """serve.json: where the server answers, while one does."""
    return _read(state.serve_address)


@dataclass
class ServeStatus:
    """One state directory's server: ``state`` is 'up', 'not answering', 'starting', 'pending',
    'stopping' (its job is being cleaned up), 'ended', 'none' (never started here) or 'unknown' (started
    with --local on another machine, no address yet)."""

    path: Path
    state: str
    job: dict[str, Any] | None = None
    address: dict[str, Any] | None = None
    slurm_state: str | None = None
    reason: str | None = None
    nodes: str | None = None
    elapsed: str | None = None
    time_limit: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state in STATES_ACTIVE

    @property
    def url(self) -> str | None:
        return self.address.get("url") if self.address else None

    def log(self) -> Path | None:
        return RunDir(self.path).serve_log(self.job["job_id"]) if self.job else None

    def to_json(self) -> dict[str, Any]:
        job, address = self.job or {}, self.address or {}
        return {
            "path": str(self.path),
            "state": self.state,
            "address": address.get("address"),
            "url": self.url,
            "model": address.get("model") or job.get("model"),
            "model_dir": address.get("model_dir") or job.get("model_dir"),
            "checkpoint": address.get("checkpoint") or job.get("checkpoint"),
            "engine": address.get("engine") or job.get("engine"),
            "job_id": job.get("job_id"),
            "local": bool(job.get("local")),
            "slurm_state": self.slurm_state,
            "reason": self.reason,
            "node": self.nodes or address.get("node"),
            "elapsed": self.elapsed,
            "time_limit": self.time_limit,
            "log": str(self.log()) if self.job else None,
            "notes": self.notes,
        }

    def format(self) -> str:
        info = self.to_json()
        if self.state == "none":
            return f"{self.path}: no server has been started here (jobgen serve {self.path})"
        where = f" at {info['address']} ({info['url']})" if self.state in ("up", "not answering") else ""
        lines = [f"{self.path}: {self.state}{where}"]
        job = f"job {info['job_id']}" + (" (--local)" if info["local"] else "")
        if self.slurm_state:
            job += f", {self.slurm_state}"
            if self.reason and self.reason != "None":
                job += f" ({self.reason})"
        if self.elapsed and self.time_limit:
            job += f", {self.elapsed} of {self.time_limit}"
        if info["node"]:
            job += f", on {info['node']}"
        lines.append(f"  {job}")
        checkpoint = f", checkpoint {info['checkpoint']}" if info["checkpoint"] else ""
        lines.append(f"  model '{info['model']}'{checkpoint}, engine {info['engine']}: {info['model_dir']}")
        lines.append(f"  log {info['log']}")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def _local_alive(job: dict[str, Any]) -> bool | None:
    """Whether a --local server's script is still running; None when it was started on
    another machine, where only its address can tell."""
    import psutil

    if job.get("host") != socket.gethostname():
        return None
    try:
        process = psutil.Process(int(job["pid"]))
        return str(job.get("script", "")) in " ".join(process.cmdline()) and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def serve_status(state: RunDir, *, probe: bool = True) -> ServeStatus:
    """Where the server of ``state`` stands: one squeue call, and with ``probe`` one GET of
    /v1/models when an address is recorded."""
    job = read_job(state)
    address = read_address(state)
    if job is None:
        status = ServeStatus(state.path, "none", address=address)
        if address:
            status.notes.append(f"{state.serve_address} has no serve-job.json beside it: stale")
        return status
    ours = address is not None and str(address.get("job_id")) == str(job.get("job_id"))
    status = ServeStatus(state.path, "ended", job=job, address=address if ours else None)
    if job.get("local"):
        alive = _local_alive(job)
        if alive is None:
            status.notes.append(f"started with --local on {job.get('host')}: stop it there")
            if not ours:
                status.state = "unknown"
                return status
            alive = True  # its address is there: whether it answers tells the rest
        status.slurm_state = "RUNNING" if alive else None
    else:
        entries = slurm.queue([int(job["job_id"])])
        entry = entries[0] if entries else None
        alive = entry is not None and entry.state in slurm.JOB_ACTIVE
        if entry is not None:
            status.slurm_state, status.reason, status.nodes = entry.state, entry.reason, entry.nodes or None
            status.elapsed, status.time_limit = entry.elapsed, entry.time_limit
        if alive and entry.state in slurm.JOB_PENDING:
            status.state = "pending"
            return status
        if alive and entry.state in slurm.JOB_ENDING:
            status.state = "stopping"
            return status
    if not alive:
        if ours:
            status.notes.append(f"{state.serve_address} is stale: the job ended without removing it")
        return status
    if not ours:
        status.state = "starting"
        return status
    up = not probe or answers(str(address.get("url")), str(address.get("model")), timeout=5.0)
    status.state = "up" if up else "not answering"
    return status


def stop_serve(state: RunDir, *, wait: float = STOP_WAIT_SECONDS) -> str:
    """Stop the serve job of ``state`` (scancel, or SIGTERM to a --local script) and wait, at most
    ``wait`` seconds, for it to end; then no serve.json of it is left. Returns what was done."""
    status = serve_status(state, probe=False)
    job = status.job
    if job is None:
        return f"{state.path}: no serve job to stop"
    job_id = str(job["job_id"])
    if job.get("local") and job.get("host") != socket.gethostname():
        raise ServeStateError(f"serve job {job_id} runs with --local on {job.get('host')}: stop it there")
    if status.active:
        if job.get("local"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(job["pid"]), signal.SIGTERM)
        else:
            slurm.cancel(job_id)
        deadline = time.monotonic() + wait
        while (still := serve_status(state, probe=False)).active and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        done = f"stopped serve job {job_id}"
        if still.active:
            done = f"asked serve job {job_id} to stop; it is still {still.state} after {wait:.0f}s"
    else:
        done = f"serve job {job_id} had already ended"
    address = read_address(state)
    if address is not None and str(address.get("job_id")) == job_id:
        # The job was killed before it could remove its address (SIGKILL, a lost node, a
        # job still completing after the wait): the file must not point clients at nothing.
        with contextlib.suppress(FileNotFoundError):
            state.serve_address.unlink()
    return f"{done}; {state.serve_address} is gone"


def ensure_not_serving(state: RunDir) -> None:
    """Refuse a second server for one state directory; clear a stale address of an ended job."""
    status = serve_status(state, probe=False)
    if status.active:
        job_id = status.job["job_id"] if status.job else "?"
        raise ServeStateError(
            f"{state.path} is already served by job {job_id} ({status.state}): "
            f"jobgen serve {state.path} --status, or --stop it first"
        )
    address = read_address(state)
    if address is not None:
        with contextlib.suppress(FileNotFoundError):
            state.serve_address.unlink()


def wait_until_up(state: RunDir, job_id: int, *, timeout: float | None = None) -> ServeStatus:
    """Poll until job ``job_id`` answers, or has ended, or ``timeout`` seconds have passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = serve_status(state)
        mine = status.job is not None and str(status.job.get("job_id")) == str(job_id)
        if not mine or status.state in ("up", "ended"):
            return status
        if deadline is not None and time.monotonic() > deadline:
            return status
        time.sleep(POLL_SECONDS)
