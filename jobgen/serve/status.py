"""Where a served model stands, and stopping its server: ``jobgen serve RUN --status | --stop``.

    jobgen serve RUN --status [--json]   # up (where, which job, which model), starting, pending, ended
    jobgen serve RUN --stop              # scancel the serve job; its address file goes

The state directory (the run, or the model directory served as it is) holds two records:
``serve-job.json``, written by ``jobgen serve`` when it starts a job, and ``serve.json``, the
address the job writes once the server answers (jobgen.serve.node). Slurm says whether the
job is still queued or running (through jobgen.slurm.client); a GET of ``/v1/models`` says whether
the server answers. Looking changes nothing: a stale ``serve.json`` (a job killed outright,
a lost node) is removed by ``--stop`` and by the next ``jobgen serve``.

Both records are input (jobgen.serve.records): a damaged one is a ServeStateError naming the
file. A ``serve-job.json`` is this directory's only when the script it names is this
directory's ``serve.sbatch``: a copied run keeps its original's, whose job is not acted on
from the copy. A ``--local`` pid is signalled only while it is provably the script jobgen
started (jobgen.serve.records). With ``[serve] api_key_env`` the key is read from this
process's environment, by the name serve.json records.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobgen.runs.rundir import RunDir
from jobgen.serve.node import answers, refuses_without_key
from jobgen.serve.records import NotOurs, RecordError, read_record, same_path, signal_if_ours, why_not_ours
from jobgen.serve.render import SCRIPT_PROGRAM
from jobgen.slurm import client as slurm

# How long --stop waits for the job to leave the queue: Slurm's KillWait (30 s) and a margin.
STOP_WAIT_SECONDS = 60.0
POLL_SECONDS = 1.0
# Job states of a server that is not there yet, or still there.
STATES_ACTIVE = ("pending", "starting", "up", "not answering", "stopping", "unknown")


class ServeStateError(RuntimeError):
    """A serve record cannot be read, or the server cannot be reached; the message says which."""


def _read(path: Path) -> dict[str, Any] | None:
    """A serve record, None when there is none; one that cannot be read is a ServeStateError
    naming the file (a traceback never, nor a guess at what it meant)."""
    try:
        return read_record(path)
    except RecordError as exc:
        raise ServeStateError(str(exc)) from None


def read_job(state: RunDir) -> dict[str, Any] | None:
    """serve-job.json: the serve job `jobgen serve` started last."""
    job = _read(state.serve_job)
    if job is None:
        return None
    job_id = job.get("job_id")
    if isinstance(job_id, bool) or not re.fullmatch(r"[0-9]{1,18}", str(job_id)):
        raise ServeStateError(f"{state.serve_job} names no job id (job_id {shown(job_id, 40)})")
    return {**job, "job_id": str(job_id)}


def read_address(state: RunDir) -> dict[str, Any] | None:
    """serve.json: where the server answers, while one does."""
    address = _read(state.serve_address)
    if address is not None and not (isinstance(address.get("url"), str) and "job_id" in address):
        raise ServeStateError(f"{state.serve_address} is unreadable: it names no url and job_id")
    return address


def _address_noted(state: RunDir, notes: list[str]) -> dict[str, Any] | None:
    """serve.json, or None with a note when it cannot be read: an address is only a hint
    (the job is what Slurm or the process says), and a damaged one must not stop a --stop."""
    try:
        return read_address(state)
    except ServeStateError as exc:
        notes.append(f"{exc}: ignored")
        return None


def shown(value: object, limit: int = 200) -> str:
    """A value from a file, as one line a terminal shows as it is: control characters escaped."""
    text = str(value)[:limit]
    return text if text.isprintable() else repr(text)[1:-1]


def is_here(state: RunDir, job: dict[str, Any]) -> bool:
    """Whether serve-job.json was written for this directory: the script it names is this
    directory's serve.sbatch. A run directory copied or moved keeps the record of the
    directory it was copied from, whose job is not this one's to report or stop."""
    return same_path(job.get("script"), state.script(SCRIPT_PROGRAM))


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
    # Why a --local record's pid was not taken for its server's script (jobgen.serve.records).
    not_ours: NotOurs | None = None

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
        info = {key: None if value is None else shown(value) for key, value in self.to_json().items()}
        notes = [f"  {shown(note, 400)}" for note in self.notes]
        if self.state == "none":
            return "\n".join([f"{self.path}: no server has been started here (jobgen serve {self.path})", *notes])
        where = f" at {info['address']} ({info['url']})" if self.state in ("up", "not answering") else ""
        lines = [f"{self.path}: {self.state}{where}"]
        job = f"job {info['job_id']}" + (" (--local)" if self.to_json()["local"] else "")
        if self.slurm_state:
            job += f", {self.slurm_state}"
            if self.reason and self.reason != "None":
                job += f" ({shown(self.reason)})"
        if self.elapsed and self.time_limit:
            job += f", {self.elapsed} of {self.time_limit}"
        if info["node"]:
            job += f", on {info['node']}"
        lines.append(f"  {job}")
        checkpoint = f", checkpoint {info['checkpoint']}" if info["checkpoint"] else ""
        lines.append(f"  model '{info['model']}'{checkpoint}, engine {info['engine']}: {info['model_dir']}")
        lines.append(f"  log {info['log']}")
        return "\n".join(lines + notes)


def _local_alive(state: RunDir, job: dict[str, Any], status: ServeStatus) -> bool | None:
    """Whether a --local server's script is still running; None when it was started on
    another machine, where only its address can tell. A pid that is not provably the script
    jobgen started (jobgen.serve.records) is not taken for it."""
    if job.get("host") != socket.gethostname():
        return None
    why = why_not_ours(state, job, state.script(SCRIPT_PROGRAM))
    status.not_ours = why
    if why is not None and not why.gone:
        status.notes.append(f"not taken for this directory's server: {why}")
    return why is None


def _probe(status: ServeStatus, address: dict[str, Any]) -> str:
    """'up' or 'not answering': one GET of /v1/models, with the key when the server asks for
    one and this shell has it (from a serve.json this directory's owner wrote, never another's)."""
    url, model, name = str(address.get("url")), str(address.get("model")), address.get("api_key_env")
    key = client_key(status.path, address) if isinstance(name, str) else None
    if answers(url, model, timeout=5.0, key=key):
        return "up"
    if isinstance(name, str) and key is None and refuses_without_key(url, timeout=5.0):
        status.notes.append(f"the server asks for the API key in ${shown(name, 128)}, which is not set here")
        return "up"
    return "not answering"


def client_key(path: Path, address: dict[str, Any]) -> str | None:
    """The API key a client sends to the server serve.json names: the value of the variable
    serve.json names, in this process's environment. None when it is not set, or when serve.json
    is not the directory owner's: a file someone else put there could point the key at their
    own address."""
    name = address.get("api_key_env")
    if not isinstance(name, str) or not os.environ.get(name):
        return None
    try:
        if (path / "serve.json").stat().st_uid != path.stat().st_uid:
            return None
    except OSError:
        return None
    return os.environ[name]


def serve_status(state: RunDir, *, probe: bool = True) -> ServeStatus:
    """Where the server of ``state`` stands: one squeue call, and with ``probe`` one GET of
    /v1/models when an address is recorded."""
    job = read_job(state)
    notes: list[str] = []
    address = _address_noted(state, notes)
    if job is not None and not is_here(state, job):
        script = job.get("script")
        of = f"of {shown(script)}, not of this directory (copied or moved?)" if script else "and no script of it"
        notes.append(f"{state.serve_job} names serve job {job['job_id']} {of}: not acted on here")
        job = None
    if job is None:
        status = ServeStatus(state.path, "none", address=address, notes=notes)
        if address:
            status.notes.append(f"{state.serve_address} has no serve-job.json of this directory beside it: stale")
        return status
    ours = address is not None and str(address.get("job_id")) == job["job_id"]
    status = ServeStatus(state.path, "ended", job=job, address=address if ours else None, notes=notes)
    if job.get("local"):
        alive = _local_alive(state, job, status)
        if alive is None:
            status.notes.append(f"started with --local on {shown(job.get('host'))}: stop it there")
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
    status.state = _probe(status, address) if probe else "up"
    return status


def stop_serve(state: RunDir, *, wait: float = STOP_WAIT_SECONDS) -> str:
    """Stop the serve job of ``state`` (scancel, or SIGTERM to a --local script that is
    provably the one jobgen started) and wait, at most ``wait`` seconds, for it to end; then
    no serve.json of it is left. Returns what was done."""
    status = serve_status(state, probe=False)
    job = status.job
    if job is None:
        done = "; ".join([f"{state.path}: no serve job to stop", *status.notes])
        return done + ("; nothing was signalled" if status.notes else "")
    job_id = job["job_id"]
    if job.get("local") and job.get("host") != socket.gethostname():
        raise ServeStateError(f"serve job {job_id} runs with --local on {shown(job.get('host'))}: stop it there")
    if status.active:
        if job.get("local"):
            why = signal_if_ours(state, job, state.script(SCRIPT_PROGRAM), signal.SIGTERM)
            if why is not None and not why.gone:
                return f"serve job {job_id} not stopped: {why}; nothing was signalled"
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
        why = status.not_ours
        if why is not None:
            done = f"{done} ({shown(why, 400)})" if why.gone else f"serve job {job_id} not stopped: {shown(why, 400)}"
            done += "; nothing was signalled"
    address = _address_noted(state, [])
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
    if state.serve_address.is_file():
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
