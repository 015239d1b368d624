"""Memory snapshots inside one task (train.snapshot_every_steps): a relaunch of the trainer in
the same allocation (job.in_job_restarts) resumes from the last N steps, not the last save.

The batch script exports ``JOBGEN_SNAPSHOT_DIR``: a directory on the nodes' tmpfs (site
``paths.snapshot_dir``, ``/dev/shm``) for this attempt of this job only, so nothing an earlier
attempt left is ever read; it deletes it on every node as the task ends. Each node keeps its
files in its own subdirectory (named after the node)::

    <node>/step-00000120.rank00001.pt      a complete snapshot of rank 1 (only ever made by a rename): its
                                           own on rank 1's node, a copy on the node that mirrors it; the
                                           two newest of each rank are kept
    <node>/.tmp-step-00000124.rank00001.pt   one being written

Every ``every_steps`` steps (a step count: every rank takes the same decision without a
collective) a rank copies its own shard of the training state (what the disk checkpoint holds:
model and optimizer as :func:`get_state_dict` gives them, DTensors as their local shards; its
RNG streams; the trainer's state, the data position included) into host memory; a thread
serialises it, writes it to a temporary file and renames it into place, sends it to the rank
that mirrors it on the next node (trainer.checkpoints.snapshot_peers) and stores the copies it
receives the same way; of a rank's older files the newest stays, so a step that a killed rank
left half-mirrored has a whole step before it on every node. A relaunch
gathers which (rank, step) files each rank's node holds, takes the newest step for which every
rank's file is held somewhere when it is newer than the newest disk checkpoint, moves the files
a rank's node lacks (a rank now on a spare node) from a node that holds them, and each rank
loads its own into the model and optimizer the relaunch built (same world, same shards). A file
that fails to load on any rank makes every rank fall back to the disk checkpoint.

The files are read with ``torch.load(weights_only=True)``: tensors and plain values only.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainer.checkpoints.checkpointer import rng_state, set_rng_state, state_dict_options
from trainer.checkpoints.snapshot_peers import SnapshotPeers, node_name
from trainer.distributed import DistEnv, all_gather_object

log = logging.getLogger("trainer.checkpoints.snapshots")

DIR_ENV = "JOBGEN_SNAPSHOT_DIR"
# How long taking a snapshot waits for the previous one's writing and mirroring (a partner that
# died holds it until the group's timeout): past it, this snapshot is skipped, training goes on.
WAIT_SECONDS = 60.0
_NAME = re.compile(r"^step-(\d{8})\.rank(\d{5})\.pt$")


class SnapshotMismatch(ValueError):
    """A snapshot whose structure or shapes are not the model's and optimizer's of this launch."""


def staged(value: Any) -> Any:
    """A host copy of ``value`` that training may not change: tensors cloned to the CPU (a
    DTensor as its local shard), containers walked, plain values as they are."""
    if isinstance(value, DTensor):
        return value.to_local().detach().to("cpu", copy=True)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: staged(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(staged(item) for item in value)
    return value


def restored(current: Any, saved: Any, where: str = "state") -> Any:
    """``current`` (this launch's state, as get_state_dict gives it) with ``saved`` copied into
    its tensors in place; :class:`SnapshotMismatch` naming the first place they differ."""
    if isinstance(current, torch.Tensor):
        target = current.to_local() if isinstance(current, DTensor) else current
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(target.shape):
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise SnapshotMismatch(f"{where}: the snapshot holds {shape}, this launch {tuple(target.shape)}")
        target.copy_(saved)
        return current
    if isinstance(current, dict):
        if not isinstance(saved, dict) or set(saved) != set(current):
            raise SnapshotMismatch(f"{where}: the snapshot's keys are not this launch's")
        return {key: restored(item, saved[key], f"{where}.{key}") for key, item in current.items()}
    if isinstance(current, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(current):
            raise SnapshotMismatch(f"{where}: the snapshot's list is not this launch's")
        return type(current)(restored(c, s, f"{where}[{i}]") for i, (c, s) in enumerate(zip(current, saved)))
    return saved


class Snapshots:
    """Takes a rank's snapshots every ``every_steps`` steps, and restores the newest one every
    rank holds."""

    def __init__(self, attempt: Path, env: DistEnv, every_steps: int):
        self.directory = attempt / node_name()  # this node's files
        self.env = env
        self.every_steps = every_steps
        self.peers: SnapshotPeers | None = None  # set by connect(), on every rank or none
        self._writing: threading.Thread | None = None
        self._error: str | None = None  # why the last write failed (logged once, at the next)
        self._holders: dict[tuple[int, int], int] = {}  # (rank, step) -> a rank whose node holds it
        self._holdings: list[set[tuple[int, int]]] = []  # what each rank's node holds, by rank
        self.seconds: list[float] = []  # how long training waited for each snapshot's copy
        _private_directory(attempt)
        self.directory.mkdir(mode=0o700, exist_ok=True)
        if env.local_rank == 0:
            _remove_other_attempts(attempt)

    @classmethod
    def from_environment(cls, env: DistEnv, every_steps: int) -> Snapshots | None:
        """Where the batch script asked for them (train.snapshot_every_steps and a relaunching task)."""
        directory = os.environ.get(DIR_ENV)
        if not directory or every_steps <= 0:
            return None
        try:
            return cls(Path(directory), env, every_steps)
        except (OSError, UnsafeSnapshotDir) as exc:
            log.warning("rank %d: no memory snapshots (%s); a relaunch resumes from disk", env.rank, exc)
            return None

    def connect(self, timeout_seconds: float) -> None:
        """The mirror between nodes (collective, on every rank that takes snapshots)."""
        self.peers = SnapshotPeers.connect(self.env, timeout_seconds)

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def file(self, rank: int, step: int, prefix: str = "") -> Path:
        return self.directory / f"{prefix}step-{step:08d}.rank{rank:05d}.pt"

    def held(self) -> list[tuple[int, int]]:
        """(rank, step) of every complete snapshot file on this node."""
        found = (_NAME.match(p.name) for p in self.directory.iterdir()) if self.directory.is_dir() else ()
        return sorted((int(m.group(2)), int(m.group(1))) for m in found if m)

    # ------------------------------------------------------------------ taking

    def take(self, step: int, model: torch.nn.Module, optimizer, trainer_state: dict[str, Any]) -> None:
        """Copy this rank's state to host memory now; write and mirror it in the background."""
        began = time.monotonic()
        if not self.wait(WAIT_SECONDS):
            log.warning(
                "rank %d: the previous snapshot is still being written or mirrored: none at step %d",
                self.env.rank,
                step,
            )
            return
        model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
        payload = {
            "step": step,
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "model": staged(model_sd),
            "optim": staged(optim_sd),
            "rng": rng_state(),
            "trainer_state": json.dumps(trainer_state),
        }
        self._writing = threading.Thread(target=self._write, args=(step, payload), name="snapshot-writer", daemon=True)
        self._writing.start()
        self.seconds.append(time.monotonic() - began)

    def _write(self, step: int, payload: dict[str, Any]) -> None:
        """Serialise, keep and mirror one snapshot. The mirror's exchange happens whatever the
        tmpfs did: the partner's thread is waiting for it."""
        problems = []
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        del payload, buffer
        try:
            self._store(self.env.rank, step, data)
        except OSError as exc:  # a full tmpfs: the relaunch resumes from an older one, or the disk
            problems.append(f"{type(exc).__name__}: {exc}")
        try:
            for source, copy in self.peers.exchange(data, step) if self.peers is not None else []:
                self._store(source, step, copy)
        except (OSError, RuntimeError, ValueError) as exc:  # a full tmpfs, a partner gone or out of step
            problems.append(f"mirror: {type(exc).__name__}: {exc}")
        if problems:
            self._error = f"step {step}: {'; '.join(problems)}"

    def _store(self, rank: int, step: int, data: bytes) -> None:
        """Rank ``rank``'s snapshot of ``step`` into this node's directory; of that rank's older
        ones, the newest stays: a rank killed while the others were writing or mirroring this
        step leaves this step whole nowhere, and the one before it whole everywhere."""
        tmp, final = self.file(rank, step, ".tmp-"), self.file(rank, step)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, final)  # a tmpfs: nothing to fsync, and the file is the task's only
        finally:
            tmp.unlink(missing_ok=True)
        steps = sorted(held_step for held_rank, held_step in self.held() if held_rank == rank and held_step <= step)
        for old in steps[:-2]:
            self.file(rank, old).unlink(missing_ok=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the snapshot being written and mirrored is done (a failure is logged); False
        when ``timeout`` passed first."""
        if self._writing is not None:
            self._writing.join(timeout)
            if self._writing.is_alive():
                return False
            self._writing = None
        if self._error:
            log.warning("rank %d: a snapshot was not kept (%s); the next one is tried", self.env.rank, self._error)
            self._error = None
        return True

    # ------------------------------------------------------------------ restoring

    def newest_common(self, disk_step: int | None) -> int | None:
        """The newest step of which every rank's snapshot is held on some node (its own, or
        another node's copy where there is a mirror), if newer than ``disk_step``
        (collective: every rank gets the same answer)."""
        gathered = all_gather_object(self.env, self.held())
        self._holdings = [{(int(rank), int(step)) for rank, step in held} for held in gathered]
        self._holders = {}
        for holder, held in enumerate(self._holdings):
            for key in held:
                self._holders.setdefault(key, holder)
        steps = sorted({step for _, step in self._holders}, reverse=True)
        for step in steps:
            if all(self._reachable(rank, step) for rank in range(self.env.world_size)):
                return step if disk_step is None or step > disk_step else None
        return None

    def _reachable(self, rank: int, step: int) -> bool:
        """On the rank's own node, or on another one that can send it (the mirror's group)."""
        return (rank, step) in self._holdings[rank] or (self.peers is not None and (rank, step) in self._holders)

    def restore(self, step: int, model: torch.nn.Module, optimizer) -> dict[str, Any] | None:
        """Load snapshot ``step`` into the model, the optimizer and the RNGs (collective); the
        trainer's state, or None when any rank could not (every rank then resumes from disk)."""
        options = state_dict_options(model)
        payload, error = None, None
        try:
            data = self._fetch(step)
            payload = torch.load(io.BytesIO(data), weights_only=True)  # a snapshot this job wrote
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            model_sd = restored(model_sd, payload["model"], "model")
            optim_sd = restored(optim_sd, payload["optim"], "optim")
        except (OSError, RuntimeError, KeyError, ValueError, SnapshotMismatch) as exc:
            error = f"rank {self.env.rank}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        errors = [e for e in all_gather_object(self.env, error) if e]
        if errors:
            if self.env.is_main:
                log.error("snapshot of step %d does not load (%s): resuming from disk", step, "; ".join(errors))
            return None
        assert payload is not None
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
        set_rng_state(payload["rng"])
        return json.loads(payload["trainer_state"])

    def _fetch(self, step: int) -> bytes:
        """This rank's snapshot of ``step``: from this node's directory, or sent by the rank
        whose node holds it (every rank takes part in the moves, as newest_common planned them)."""
        me, mine = self.env.rank, self.file(self.env.rank, step)
        # Every rank computes the same moves from the gathered holdings: (holder, rank) for
        # each rank whose own node lacks its file.
        world = range(self.env.world_size)
        moves = [(self._holders[(rank, step)], rank) for rank in world if (rank, step) not in self._holdings[rank]]
        if moves and self.peers is not None:
            outgoing = {rank: self.file(rank, step).read_bytes() for holder, rank in moves if holder == me}
            received = dict(self.peers.transfer(moves, outgoing, step))
            if me in {rank for _, rank in moves}:
                return received[self._holders[(me, step)]]
        return mine.read_bytes()

    def close(self) -> None:
        self.wait()


def _remove_other_attempts(directory: Path) -> None:
    """This run's snapshots of other attempts on this node (a task killed before its batch
    script could delete them): never read, only memory held."""
    parent = directory.parent
    if not parent.is_dir():
        return
    for other in parent.iterdir():
        if other.name != directory.name:
            log.info("removing %s: the snapshots of an earlier task of this run", other)
            shutil.rmtree(other, ignore_errors=True)


class UnsafeSnapshotDir(RuntimeError):
    """The per-user directory on the tmpfs belongs to someone else: its files could be read or planted."""


def _private_directory(directory: Path) -> None:
    """``directory`` (ROOT/jobgen-UID/RUN/JOB.RESTART) and its parents below ROOT, created
    readable by this user only; a ``jobgen-UID`` someone else made is refused."""
    user_dir = directory.parent.parent
    user_dir.mkdir(mode=0o700, exist_ok=True)
    info = user_dir.lstat()
    if info.st_uid != os.getuid() or not user_dir.is_dir() or user_dir.is_symlink():
        raise UnsafeSnapshotDir(f"{user_dir} is not a directory of this user's: no snapshots are taken")
    directory.parent.mkdir(mode=0o700, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
