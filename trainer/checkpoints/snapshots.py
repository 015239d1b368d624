"""Memory snapshots inside one task (train.snapshot_every_steps): a relaunch of the trainer in
the same allocation (job.in_job_restarts) resumes from the last N steps, not the last save.

The batch script exports ``JOBGEN_SNAPSHOT_DIR``: a directory on the node's tmpfs (site
``paths.snapshot_dir``, ``/dev/shm``) for this attempt of this job only, so nothing an earlier
attempt left is ever read; it deletes it on every node as the task ends. Each rank there::

    step-00000120.rank00001.pt     the newest complete snapshot of rank 1 (only ever made by a rename)
    .tmp-step-00000124.rank00001.pt   one being written

Every ``every_steps`` steps (a step count: every rank takes the same decision without a
collective) a rank copies its own shard of the training state (what the disk checkpoint holds:
model and optimizer as :func:`get_state_dict` gives them, DTensors as their local shards; its
RNG streams; the trainer's state, the data position included) into host memory, and a thread
writes that copy to a temporary file and renames it into place; the older file goes once the
new one is complete. A relaunch asks every rank which steps it holds, takes the newest step all
of them hold when it is newer than the newest disk checkpoint, and each rank loads its own
file into the model and optimizer the relaunch built (same world, same shards). A file that
fails to load on any rank makes every rank fall back to the disk checkpoint.

The files are read with ``torch.load(weights_only=True)``: tensors and plain values only.
Not kept: a copy on another node, so a lost node's ranks have none and the relaunch resumes
from disk.
"""

from __future__ import annotations

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
from trainer.distributed import DistEnv, all_gather_object

log = logging.getLogger("trainer.checkpoints.snapshots")

DIR_ENV = "JOBGEN_SNAPSHOT_DIR"
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

    def __init__(self, directory: Path, env: DistEnv, every_steps: int):
        self.directory = directory
        self.env = env
        self.every_steps = every_steps
        self._writing: threading.Thread | None = None
        self._error: str | None = None  # why the last write failed (logged once, at the next)
        self.seconds: list[float] = []  # how long training waited for each snapshot's copy
        _private_directory(directory)
        if env.local_rank == 0:
            _remove_other_attempts(directory)

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

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def file(self, step: int, prefix: str = "") -> Path:
        return self.directory / f"{prefix}step-{step:08d}.rank{self.env.rank:05d}.pt"

    def steps(self) -> list[int]:
        """The steps of this rank's complete snapshots."""
        found = (_NAME.match(p.name) for p in self.directory.iterdir()) if self.directory.is_dir() else ()
        return sorted(int(m.group(1)) for m in found if m and int(m.group(2)) == self.env.rank)

    # ------------------------------------------------------------------ taking

    def take(self, step: int, model: torch.nn.Module, optimizer, trainer_state: dict[str, Any]) -> None:
        """Copy this rank's state to host memory now; write it in the background."""
        began = time.monotonic()
        self.wait()
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
        tmp, final = self.file(step, ".tmp-"), self.file(step)
        try:
            torch.save(payload, tmp)
            os.replace(tmp, final)  # a tmpfs: nothing to fsync, and the file is the task's only
        except OSError as exc:  # a full tmpfs: the relaunch resumes from an older one, or the disk
            tmp.unlink(missing_ok=True)
            self._error = f"{final}: {exc}"
            return
        for older in self.steps():
            if older < step:
                self.file(older).unlink(missing_ok=True)

    def wait(self) -> None:
        """Until the snapshot being written is on the tmpfs (or failed, which is logged)."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        if self._error:
            log.warning(
                "rank %d: a snapshot could not be written (%s); the next one is tried", self.env.rank, self._error
            )
            self._error = None

    # ------------------------------------------------------------------ restoring

    def newest_common(self, disk_step: int | None) -> int | None:
        """The newest step every rank holds a snapshot of, if it is newer than ``disk_step``
        (collective: every rank gets the same answer)."""
        held = all_gather_object(self.env, self.steps())
        common = set.intersection(*(set(steps) for steps in held)) if held else set()
        newest = max(common, default=None)
        return newest if newest is not None and (disk_step is None or newest > disk_step) else None

    def restore(self, step: int, model: torch.nn.Module, optimizer) -> dict[str, Any] | None:
        """Load snapshot ``step`` into the model, the optimizer and the RNGs (collective); the
        trainer's state, or None when any rank could not (every rank then resumes from disk)."""
        options = state_dict_options(model)
        payload, error = None, None
        try:
            payload = torch.load(self.file(step), weights_only=True)  # a tmpfs file this job wrote
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            model_sd = restored(model_sd, payload["model"], "model")
            optim_sd = restored(optim_sd, payload["optim"], "optim")
        except (OSError, RuntimeError, KeyError, SnapshotMismatch) as exc:
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
