"""What decides whether a memory snapshot may be restored: one rank's snapshot file read, and
everything it holds checked against this launch. trainer.checkpoints.snapshots takes, writes,
finds and restores the snapshots; trainer.checkpoints.snapshot_peers moves them between nodes.

A snapshot is input like any other file: a rank reads its file as a regular file of its own
user's (no link followed, at most :func:`file_limit` of what its own state takes), with
``torch.load(weights_only=True)`` (tensors and plain values only), and checks all of it before
anything is restored: the model's and the optimizer's tensors against this launch's (every
key, shape and dtype, every plain value's type), the RNG streams (each set on a generator of
its own first), the trainer's state (a JSON object of the step, with the types the trainer
reads). Nothing here changes the model, the optimizer or a process's RNG: the ranks agree that
every one's snapshot passed (trainer.checkpoints.snapshots.Snapshots.restore) before anything
is copied.

Whatever the file holds, the readers (:func:`read_snapshot`, :func:`checked_snapshot`) either
return a snapshot restore can copy in or raise one :class:`UnusableSnapshot` line (a missing
file aside: FileNotFoundError), never what torch.load's parts raise on damaged bytes
(tests/unit/test_fuzz_snapshots.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from jobgen.base.safe_read import DamagedFile, open_regular
from jobgen.base.visible import visible
from trainer.checkpoints.reader import UnreadableCheckpoint, read_value
from trainer.checkpoints.snapshot_peers import size_limit
from trainer.checkpoints.state_files import rng_problem, trainer_state_problem

_PAYLOAD_KEYS = {"step", "rank", "world_size", "model", "optim", "rng", "trainer_state"}
# What torch.save adds to the tensors' bytes (the pickle, the archive's records): the RNG
# streams and the trainer's state are counted in it.
_SERIALISED_OVERHEAD = 1 << 20


class UnusableSnapshot(ValueError):
    """A snapshot that may not be restored: one line saying why (what it holds may be anything:
    whitespace is collapsed and control characters escaped), the one refusal of this module's
    readers. A ValueError, as a refused snapshot was before it had a type of its own."""

    def __init__(self, message: str):
        super().__init__(visible(" ".join(str(message).split())))


class SnapshotMismatch(UnusableSnapshot):
    """A snapshot whose structure or shapes are not the model's and optimizer's of this launch."""


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _same_kind(current: Any, saved: Any) -> bool:
    """Whether ``saved`` may stand for the plain value ``current``: a bool for a bool, a number
    for a number, a string for a string; for None, any plain value."""
    if current is None:
        return _plain(saved)
    if isinstance(current, bool):
        return isinstance(saved, bool)
    if isinstance(current, int | float):
        return isinstance(saved, int | float) and not isinstance(saved, bool)
    if isinstance(current, str):
        return isinstance(saved, str)
    return type(saved) is type(current) and saved == current


def check_matches(current: Any, saved: Any, where: str = "state") -> None:
    """Raise :class:`SnapshotMismatch`, naming the first place they differ, unless ``saved``
    can be copied into ``current`` (this launch's state, as get_state_dict gives it): the same
    keys and lengths, a CPU tensor of the same shape and dtype for each tensor, a plain value
    of the same kind for each plain value. Changes nothing."""
    if isinstance(current, torch.Tensor):
        target = current.to_local() if isinstance(current, DTensor) else current
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(target.shape):
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise SnapshotMismatch(f"{where}: the snapshot holds {shape}, this launch {tuple(target.shape)}")
        if saved.dtype != target.dtype:
            raise SnapshotMismatch(f"{where}: the snapshot holds {saved.dtype}, this launch {target.dtype}")
        if isinstance(saved, DTensor) or saved.layout != torch.strided or saved.device.type != "cpu":
            raise SnapshotMismatch(f"{where}: the snapshot holds no plain CPU tensor ({saved.layout}, {saved.device})")
        return
    if isinstance(current, dict):
        if not isinstance(saved, dict) or set(saved) != set(current):
            raise SnapshotMismatch(f"{where}: the snapshot's keys are not this launch's")
        for key, item in current.items():
            check_matches(item, saved[key], f"{where}.{key}")
        return
    if isinstance(current, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(current):
            raise SnapshotMismatch(f"{where}: the snapshot's list is not this launch's")
        for i, (c, s) in enumerate(zip(current, saved)):
            check_matches(c, s, f"{where}[{i}]")
        return
    if not _same_kind(current, saved):
        raise SnapshotMismatch(
            f"{where}: the snapshot holds {type(saved).__name__}, this launch {type(current).__name__}"
        )


def check_rng(saved: Any) -> None:
    """Raise :class:`SnapshotMismatch` unless ``saved`` is RNG state as
    :func:`trainer.checkpoints.state_files.rng_state` makes it (the one check a disk checkpoint's
    RNG files get too: each stream set on a generator of its own first, the process's left as
    they are)."""
    try:
        problem = rng_problem(saved)
    except Exception as exc:  # noqa: BLE001 - a value of a type no check foresaw
        problem = f"not the RNG state the trainer writes ({type(exc).__name__})"
    if problem is not None:
        raise SnapshotMismatch(f"rng: {problem}")


def checked_trainer_state(text: Any, step: int, world_size: int) -> dict[str, Any]:
    """The trainer's state of a snapshot of ``step`` (JSON text): an object whose step is
    ``step`` and whose other keys, where present, have the types trainer.loop reads (the
    scheduler's, those LambdaLR sets); :class:`SnapshotMismatch` naming the first that is not."""
    if not isinstance(text, str):
        raise SnapshotMismatch(f"trainer_state: the snapshot holds {type(text).__name__}, not JSON text")
    try:
        state = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SnapshotMismatch(f"trainer_state: not JSON ({exc})") from None
    if not isinstance(state, dict):
        raise SnapshotMismatch("trainer_state: not a JSON object")
    if type(state.get("step")) is not int or state["step"] != step:  # a JSON true is no step 1
        raise SnapshotMismatch(f"trainer_state.step: {state.get('step')!r}, the snapshot is of step {step}")
    if state.get("world_size") is not None and state["world_size"] != world_size:
        raise SnapshotMismatch(f"trainer_state.world_size: {str(state['world_size'])[:20]!r}, not {world_size}")
    problem = trainer_state_problem(state, partial=True)
    if problem is not None:
        raise SnapshotMismatch(f"trainer_state.{problem}")
    return state


def state_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (a DTensor's local shard): what a snapshot of it
    holds, less torch.save's own records."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(state_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(state_bytes(item) for item in value)
    return 0


def file_limit(model_sd: Any, optim_sd: Any) -> int:
    """The most bytes a snapshot of this rank's state (``model_sd`` and ``optim_sd`` as
    get_state_dict gives them) may take, on disk or from the mirror."""
    return size_limit(state_bytes((model_sd, optim_sd)) + _SERIALISED_OVERHEAD)


class CheckedSnapshot(NamedTuple):
    """A snapshot's parts, each checked against this launch: what restore copies in."""

    model: Any
    optim: Any
    rng: Any
    trainer_state: dict[str, Any]


def checked_snapshot(
    data: bytes, *, step: int, rank: int, world_size: int, model_sd: Any, optim_sd: Any
) -> CheckedSnapshot:
    """The snapshot of ``step`` of ``rank`` in ``data`` (torch.save bytes), every part checked
    against this launch (``model_sd`` and ``optim_sd`` as get_state_dict gives them);
    :class:`UnusableSnapshot` (a :class:`SnapshotMismatch` naming the first part that is not
    this launch's) for anything else. Changes nothing."""
    payload = _loaded(data, f"the snapshot of step {step} of rank {rank}")
    if not isinstance(payload, dict) or set(payload) != _PAYLOAD_KEYS:
        raise SnapshotMismatch("the file is not a snapshot (its keys are not a snapshot's)")
    for key, expected in (("step", step), ("rank", rank), ("world_size", world_size)):
        # The type first: a tensor compared with an int is a tensor, whose truth may raise.
        if not isinstance(payload[key], int) or isinstance(payload[key], bool) or payload[key] != expected:
            raise SnapshotMismatch(f"{key}: the snapshot's is {str(payload[key])[:80]!r}, this one's {expected}")
    check_matches(model_sd, payload["model"], "model")
    check_matches(optim_sd, payload["optim"], "optim")
    check_rng(payload["rng"])
    state = checked_trainer_state(payload["trainer_state"], step, world_size)
    return CheckedSnapshot(payload["model"], payload["optim"], payload["rng"], state)


def _loaded(data: bytes, where: str) -> Any:
    """What ``data`` holds, read as reader.read_value reads it (a stored zip, weights_only, a
    global it will not load named); :class:`UnusableSnapshot` for bytes it refuses or cannot
    read. torch.load of damaged bytes raises whatever its parts do (miniz's RuntimeError,
    the unpickler's EOFError or IndexError, a record name's UnicodeDecodeError, ValueError for
    a byte order), each of them a snapshot that does not load. Running out of memory is no
    verdict on the file: MemoryError goes on."""
    try:
        return read_value(data, where)
    except UnreadableCheckpoint as exc:  # CheckpointRefused too: one line, naming the snapshot
        raise UnusableSnapshot(str(exc)) from None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - see above: whatever torch.load's parts raise
        raise UnusableSnapshot(f"cannot read {where}: {type(exc).__name__}: {str(exc)[:200]}") from None


def read_snapshot(path: Path, limit: int) -> bytes:
    """The bytes of the snapshot file ``path``: a regular file (a link is not followed) of this
    user's, of at most ``limit`` bytes. FileNotFoundError when there is none,
    :class:`UnusableSnapshot` for anything else."""
    try:
        fd = open_regular(path)
    except DamagedFile as exc:  # a link, a FIFO, a directory, one that cannot be opened
        raise UnusableSnapshot(str(exc)) from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise UnusableSnapshot(f"{path} is not this user's file (owner uid {info.st_uid})")
        if info.st_size > limit:
            raise UnusableSnapshot(f"{path} holds {info.st_size} bytes, more than the {limit} this rank's state takes")
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 24, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise UnusableSnapshot(f"{path} grew past {limit} bytes while it was read")
    except OSError as exc:
        raise UnusableSnapshot(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)
