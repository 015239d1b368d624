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

Every level of it below the tmpfs (``jobgen-<uid>/<run>/<job>.<restart>/<node>``) must be a
directory of this user's, closed to others: ``jobgen-<uid>`` made by someone else (who could
then read the snapshots, or plant their own) turns snapshots off, and the trainer records why
in the run directory (``RunDir.snapshots_off``), where ``jobgen status`` shows it.

Every ``every_steps`` steps (a step count: every rank takes the same decision without a
collective) a rank copies its own shard of the training state (what the disk checkpoint holds:
model and optimizer as :func:`get_state_dict` gives them, DTensors as their local shards; its
RNG streams; the trainer's state, the data position included) into host memory; a thread
serialises it, writes it to a temporary file and renames it into place, sends it to the rank
that mirrors it on the next node (trainer.checkpoints.snapshot_peers, which authenticates
what it moves) and stores the copies it receives the same way; of a rank's older files the
newest stays, so a step that a killed rank left half-mirrored has a whole step before it on
every node. A relaunch gathers which (rank, step) files each rank's node holds, takes the
newest step for which every rank's file is held somewhere when it is newer than the newest
disk checkpoint, moves the files a rank's node lacks (a rank now on a spare node) from a node
that holds them, and each rank loads its own into the model and optimizer the relaunch built
(same world, same shards).

A snapshot is input like any other file: whether one may be restored (its file read as a regular
file of this user's, of bounded size, with ``weights_only``; every tensor, RNG stream and
trainer's counter checked against this launch) is decided in trainer.checkpoints.snapshot_checks.
Any failure on any rank, whatever it is, sends every rank to the disk checkpoint, agreed by one
all-reduce before a single tensor, RNG stream or counter is changed.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pwd
import re
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from jobgen.base.atomic import write_json_atomic
from jobgen.runs.rundir import RunDir
from trainer.checkpoints.checkpointer import state_dict_options
from trainer.checkpoints.snapshot_checks import check_matches, checked_snapshot, file_limit, read_snapshot
from trainer.checkpoints.snapshot_peers import SnapshotPeers, node_name
from trainer.checkpoints.state_files import rng_state, set_rng_state
from trainer.distributed import DistEnv, all_gather_object, reduce_sum

log = logging.getLogger("trainer.checkpoints.snapshots")

DIR_ENV = "JOBGEN_SNAPSHOT_DIR"
RUN_DIR_ENV = "JOBGEN_RUN_DIR"  # where the refusal of a snapshot directory is recorded
# How long taking a snapshot waits for the previous one's writing and mirroring (a partner that
# died holds it until the group's timeout): past it, this snapshot is skipped, training goes on.
WAIT_SECONDS = 60.0
# How long the trainer's end waits for the snapshot in flight. A copy to a partner whose node is gone
# waits for the group's timeout (train.collective_timeout: minutes), which would hold the rank's exit
# record and the task's end; the snapshot files are deleted as the task ends anyway.
CLOSE_WAIT_SECONDS = 30.0
_NAME = re.compile(r"^step-(\d{8})\.rank(\d{5})\.pt$")


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


def _copied(current: Any, saved: Any) -> Any:
    """``current`` with ``saved`` copied into its tensors in place (checked by check_matches)."""
    if isinstance(current, torch.Tensor):
        (current.to_local() if isinstance(current, DTensor) else current).copy_(saved)
        return current
    if isinstance(current, dict):
        return {key: _copied(item, saved[key]) for key, item in current.items()}
    if isinstance(current, list | tuple):
        return type(current)(_copied(c, s) for c, s in zip(current, saved))
    return saved


def restored(current: Any, saved: Any, where: str = "state") -> Any:
    """``current`` (this launch's state, as get_state_dict gives it) with ``saved`` copied into
    its tensors in place; snapshot_checks.SnapshotMismatch naming the first place they differ,
    before anything is copied."""
    check_matches(current, saved, where)
    return _copied(current, saved)


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
        _own_directory(self.directory)
        if env.local_rank == 0:
            _remove_other_attempts(attempt)

    @classmethod
    def from_environment(cls, env: DistEnv, every_steps: int) -> Snapshots | None:
        """Where the batch script asked for them (train.snapshot_every_steps and a relaunching
        task). A directory that cannot be used is recorded in the run directory
        (``RunDir.snapshots_off``, for ``jobgen status``) as well as in the rank's log."""
        directory = os.environ.get(DIR_ENV)
        if not directory or every_steps <= 0:
            return None
        try:
            snapshots = cls(Path(directory), env, every_steps)
        except (OSError, UnsafeSnapshotDir) as exc:
            log.warning("rank %d: no memory snapshots (%s); a relaunch resumes from disk", env.rank, exc)
            _record_refusal(exc)
            return None
        if env.is_main:
            _forget_old_refusals()
        return snapshots

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
        except (OSError, RuntimeError, ValueError) as exc:  # a full tmpfs, a partner gone or out of step, a refusal
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
        trainer's state, or None when any rank could not (every rank then resumes from disk).
        Each rank reads and checks all of its snapshot first; the ranks agree (one all-reduce)
        that every one could before anything is changed."""
        options = state_dict_options(model)
        error, checked, limit = None, None, 0
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            limit = file_limit(model_sd, optim_sd)
        except Exception as exc:  # noqa: BLE001 - this rank cannot restore; it still takes part in the moves
            error = exc
        try:
            data = self._fetch(step, limit)  # collective where files move between nodes
            if error is None:
                checked = checked_snapshot(
                    data,
                    step=step,
                    rank=self.env.rank,
                    world_size=self.env.world_size,
                    model_sd=model_sd,
                    optim_sd=optim_sd,
                )
        except Exception as exc:  # noqa: BLE001 - any failure on any rank: every rank resumes from disk
            error = error or exc
        if error is not None:
            reason = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            log.error("rank %d: snapshot of step %d does not load (%s)", self.env.rank, step, reason)
        (failed,) = reduce_sum(self.env, [float(error is not None)])
        if failed:
            if self.env.is_main:
                log.error(
                    "snapshot of step %d does not load on %d rank(s) (each rank's log says why): resuming from disk",
                    step,
                    int(failed),
                )
            return None
        assert checked is not None
        saved_model, saved_optim, rng, trainer_state = checked
        model_sd, optim_sd = _copied(model_sd, saved_model), _copied(optim_sd, saved_optim)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
        set_rng_state(rng)
        return trainer_state

    def _fetch(self, step: int, limit: int) -> bytes:
        """This rank's snapshot of ``step`` (at most ``limit`` bytes): from this node's
        directory, or sent by the rank whose node holds it. Every rank takes part in the moves,
        as newest_common planned them, whatever it could read: a file it cannot read is
        announced as missing and its receiver fails."""
        me = self.env.rank
        # Every rank computes the same moves from the gathered holdings: (holder, rank) for
        # each rank whose own node lacks its file.
        world = range(self.env.world_size)
        moves = [(self._holders[(rank, step)], rank) for rank in world if (rank, step) not in self._holdings[rank]]
        if moves and self.peers is not None:
            outgoing = {rank: self._read_or_none(rank, step, limit) for holder, rank in moves if holder == me}
            received = dict(self.peers.transfer(moves, outgoing, step, limit))
            if me in {rank for _, rank in moves}:
                return received[self._holders[(me, step)]]
        return read_snapshot(self.file(me, step), limit)

    def _read_or_none(self, rank: int, step: int, limit: int) -> bytes | None:
        try:
            return read_snapshot(self.file(rank, step), limit)
        except Exception as exc:  # noqa: BLE001 - the receiver is told there is none
            log.error("rank %d: cannot send rank %d its snapshot of step %d (%s)", self.env.rank, rank, step, exc)
            return None

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> bool:
        """The trainer's end: waits for the snapshot in flight at most ``timeout`` s. False when it
        was left behind: its thread (a daemon, which the process's exit ends) may be inside a
        collective of the mirror, which destroying the process group would wait for."""
        if self.wait(timeout):
            return True
        log.warning(
            "rank %d: the snapshot in flight was still being written or mirrored %.0f s after training "
            "ended (a mirror partner gone?): left behind; a relaunch resumes from the one before it or from disk",
            self.env.rank,
            timeout,
        )
        return False


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
    """A directory of the snapshots on the tmpfs that belongs to someone else, or is no
    directory: its files could be read or planted. ``path`` and its owner's uid."""

    def __init__(self, path: Path, owner_uid: int | None, problem: str):
        self.path = path
        self.owner_uid = owner_uid
        super().__init__(f"{path} {problem}: no snapshots are taken")


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _own_directory(path: Path) -> None:
    """``path``, made if missing (its parent must exist): a directory (no link) of this user's,
    closed to everyone else; :class:`UnsafeSnapshotDir` when it is someone else's or no directory."""
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeSnapshotDir(path, info.st_uid, "is not a directory (a link, or a file)")
    if info.st_uid != os.getuid():
        raise UnsafeSnapshotDir(path, info.st_uid, f"belongs to {user_name(info.st_uid)}, not to this user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700, follow_symlinks=False)


def _private_directory(directory: Path) -> None:
    """``directory`` (ROOT/jobgen-UID/RUN/JOB.RESTART) and its parents below ROOT, created
    readable by this user only; any of them someone else made is refused."""
    for level in (directory.parent.parent, directory.parent, directory):
        _own_directory(level)


def _attempt() -> tuple[str, int]:
    return os.environ.get("SLURM_JOB_ID") or "local", int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def _record_refusal(exc: BaseException) -> None:
    """Why this rank takes no snapshots, in the run directory for ``jobgen status`` (one
    record per attempt: ``RunDir.snapshots_off``); nothing where no run directory is known."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    job_id, restart = _attempt()
    owner = exc.owner_uid if isinstance(exc, UnsafeSnapshotDir) else None
    record = {
        "job_id": job_id,
        "restart": restart,
        "node": node_name(),
        "directory": str(exc.path) if isinstance(exc, UnsafeSnapshotDir) else os.environ.get(DIR_ENV),
        "owner_uid": owner,
        "owner": user_name(owner) if owner is not None and owner != os.getuid() else None,
        "reason": f"{type(exc).__name__}: {exc}",
        "time": time.time(),
    }
    try:
        write_json_atomic(RunDir(Path(run_dir)).snapshots_off(job_id, restart), record)
    except OSError as exc2:
        log.warning("could not record in %s that snapshots are off (%s)", run_dir, exc2)


def _forget_old_refusals() -> None:
    """The records of earlier attempts whose snapshots were off: this one's are on, where
    every rank could make its directory (a rank that could not records this attempt's)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    current = RunDir(Path(run_dir)).snapshots_off(*_attempt())
    for path in RunDir(Path(run_dir)).snapshots_off_records():
        if path != current:
            path.unlink(missing_ok=True)
