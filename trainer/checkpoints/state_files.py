"""What a checkpoint and a memory snapshot hold besides the model and optimizer: each rank's RNG
streams and the trainer's state, written, read back as untrusted input, and checked in full
before anything is restored.

Both a disk checkpoint (trainer.checkpoints.checkpointer: ``rng-rank*.pt``,
``trainer_state.json``) and a memory snapshot (trainer.checkpoints.snapshot_checks) carry them,
and both read them through the one check of each here: an RNG state is the streams
:func:`rng_state` writes (torch's, Python's and numpy's Mersenne Twisters, the GPUs' where the
saving process had them), each tried on a generator of its own so the process's streams stay as
they are; a trainer state has the types trainer.loop's ``load_state_dict`` reads (counts,
the sampler's position, the scheduler's keys, which LambdaLR sets as attributes: no other key is
taken). A file is a regular file of bounded size, never a link or a FIFO, loaded with
``torch.load(weights_only=True)`` of its stored zip (trainer.checkpoints.reader.read_value).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobgen.base.safe_read import SMALL_FILE, DamagedFile, is_finite, is_int, is_number, parse_json
from trainer.checkpoints.reader import UnreadableCheckpoint, read_file, read_value


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this rank, as tensors and plain numbers only, so that loading it
    needs no unpickling of arbitrary objects (``torch.load(weights_only=True)``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, mt, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    if "cuda" in state and torch.cuda.is_available():
        # The GPUs this process sees (a node of a resume may have fewer than the saving one).
        for device, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(saved, device)


def save_rng(path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(rng_state(), fh)
        fh.flush()
        os.fsync(fh.fileno())  # like DCP's shards: a checkpoint is durable before its rename


# The most an RNG file may hold: one is about 20 KiB (torch's and numpy's Mersenne Twisters,
# Python's), and 16 bytes more per GPU.
RNG_FILE_LIMIT = 1 << 20
_MT_WORDS = 624  # the state words of a Mersenne Twister (Python's random, numpy's legacy RandomState)
_RNG_STREAMS = {"torch", "python", "numpy"}  # and "cuda" where the saving process had a GPU


def rng_problem(state: Any) -> str | None:
    """What is wrong with ``state`` as RNG state that :func:`set_rng_state` can take in this
    process (the structure :func:`rng_state` writes), or None. Each stream is tried on a
    generator of its own: the process's streams are left as they are."""
    if not isinstance(state, dict) or not _RNG_STREAMS <= set(state) <= _RNG_STREAMS | {"cuda"}:
        return "not the RNG state the trainer writes (torch, python and numpy streams)"
    current = torch.get_rng_state()
    found = state["torch"]
    if not _byte_tensor(found) or found.shape != current.shape:
        return f"torch: {_describe(found)}, not the {tuple(current.shape)} bytes of torch.get_rng_state()"
    py = state["python"]
    if not isinstance(py, dict) or set(py) != {"version", "state", "gauss"}:
        return "python: not the state of Python's random"
    words = py["state"]
    if not (is_int(py["version"]) and py["version"] == random.getstate()[0]):
        return "python.version: not the version of this Python's random"
    if not (py["gauss"] is None or isinstance(py["gauss"], float)):
        return "python.gauss: not a number"
    if not _int_tensor(words, _MT_WORDS + 1) or int(words[-1]) > _MT_WORDS:
        return f"python.state: {_describe(words)}, not {_MT_WORDS + 1} 32-bit words (int64) of a Mersenne Twister"
    npy = state["numpy"]
    if not isinstance(npy, dict) or set(npy) != {"name", "keys", "pos", "has_gauss", "cached_gaussian"}:
        return "numpy: not the state of numpy's random"
    if not (isinstance(npy["name"], str) and npy["name"] == "MT19937"):
        return "numpy.name: not MT19937, the generator of numpy's random"
    if not _int_tensor(npy["keys"], _MT_WORDS):
        return f"numpy.keys: {_describe(npy['keys'])}, not {_MT_WORDS} 32-bit words (int64) of a Mersenne Twister"
    if not (is_int(npy["pos"]) and 0 <= npy["pos"] <= _MT_WORDS):
        return "numpy.pos: not a position in a Mersenne Twister's state"
    if not (is_int(npy["has_gauss"]) and npy["has_gauss"] in (0, 1)):
        return "numpy.has_gauss: not 0 or 1"
    if not isinstance(npy["cached_gaussian"], float):
        return "numpy.cached_gaussian: not a number"
    try:
        torch.Generator().set_state(found)
        random.Random().setstate((py["version"], tuple(int(v) for v in words.tolist()), py["gauss"]))
        np.random.RandomState().set_state(
            (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
        )
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        return f"a stream does not take it ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    if "cuda" in state:
        return _cuda_rng_problem(state["cuda"])
    return None


def _cuda_rng_problem(states: Any) -> str | None:
    """What is wrong with the saved CUDA streams (a list of byte tensors, one per GPU), or None.
    Without a GPU they are not restored (:func:`set_rng_state`), so only their type counts."""
    if not isinstance(states, list) or not all(_byte_tensor(s) for s in states):
        return "cuda: not a list of GPU generator states (byte tensors)"
    if not torch.cuda.is_available():
        return None
    # A resume on a node with fewer GPUs than the saving one had is no damage: set_rng_state
    # sets the streams of the GPUs this process has, and checks them here.
    states = states[: torch.cuda.device_count()]
    shape = torch.cuda.get_rng_state().shape  # what rng_state saved, GPU by GPU
    if any(saved.shape != shape for saved in states):
        return f"cuda: not the {tuple(shape)} bytes of a GPU generator's state"
    try:
        for saved in states:
            torch.Generator(device="cuda").set_state(saved)
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"cuda: a GPU generator does not take it ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    return None


def _byte_tensor(value: Any) -> bool:
    return (
        type(value) is torch.Tensor
        and value.dtype == torch.uint8
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and value.dim() == 1
    )


def _int_tensor(value: Any, length: int) -> bool:
    """``length`` int64 words of a Mersenne Twister: each a 32-bit value (Python's last one,
    the position, at most 624)."""
    if not (
        type(value) is torch.Tensor
        and value.dtype == torch.int64
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and tuple(value.shape) == (length,)
    ):
        return False
    return bool(((value >= 0) & (value < 2**32)).all())


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of {str(value.dtype).removeprefix('torch.')}, shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def check_rng_state(state: Any, path: Path) -> dict[str, Any]:
    """``state`` (read from ``path``) if :func:`set_rng_state` can take it in this process;
    :class:`UnreadableCheckpoint` naming the file and what is wrong otherwise."""
    try:
        problem = rng_problem(state)
    except Exception as exc:  # noqa: BLE001 - a value of a type no check above foresaw
        problem = f"not the RNG state the trainer writes ({type(exc).__name__})"
    if problem is not None:
        raise UnreadableCheckpoint(f"cannot read {path}: {problem}")
    return state


def load_rng(path: Path) -> dict[str, Any] | None:
    """The RNG state in ``path`` (None when there is no such file: a rank beyond the world that
    saved the checkpoint), read as untrusted input: a regular file (never a link, a FIFO or a
    device) of at most :data:`RNG_FILE_LIMIT` bytes, ``torch.load(weights_only=True)`` of its
    stored zip (trainer.checkpoints.reader.read_value: a planted pickle must not run code), then
    :func:`check_rng_state`. Raises :class:`UnreadableCheckpoint` (CheckpointRefused) naming it."""
    try:
        data = read_file(path, RNG_FILE_LIMIT)
    except FileNotFoundError:
        return None
    return check_rng_state(read_value(data, str(path)), path)


# What LambdaLR's state_dict holds (trainer.optim.build_scheduler), in this torch and earlier
# ones: load_state_dict sets each as an attribute of the scheduler, so no other key is taken.
_SCHEDULER_LISTS = {"base_lrs", "_last_lr"}
_SCHEDULER_INTS = {"last_epoch", "_step_count"}
_SCHEDULER_FLAGS = {"verbose", "_is_initial", "_get_lr_called_within_step"}
_SCHEDULER_KEYS = _SCHEDULER_LISTS | _SCHEDULER_INTS | _SCHEDULER_FLAGS | {"lr_lambdas"}


def _count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _scheduler_problem(state: Any) -> str | None:
    if not isinstance(state, dict) or not {"base_lrs", "last_epoch"} <= set(state):
        return "scheduler: not the state of the learning-rate schedule"
    unknown = sorted(set(state) - _SCHEDULER_KEYS, key=str)
    if unknown:
        return f"scheduler: {str(unknown[0])[:80]!r} is no part of the learning-rate schedule's state"
    for key in _SCHEDULER_LISTS & set(state):
        if not (isinstance(state[key], list) and all(is_finite(v) for v in state[key])):
            return f"scheduler.{key}: not a list of learning rates"
    for key in _SCHEDULER_INTS & set(state):
        if not is_int(state[key]):
            return f"scheduler.{key}: not an integer"
    for key in _SCHEDULER_FLAGS & set(state):
        # verbose: "deprecated" in the state of torch 2.2 to 2.6's schedulers
        if not (isinstance(state[key], bool) or (key == "verbose" and isinstance(state[key], str))):
            return f"scheduler.{key}: not true or false"
    lambdas = state.get("lr_lambdas", [])
    if not isinstance(lambdas, list) or not all(
        fn is None or (isinstance(fn, dict) and all(is_int(v) for v in fn.values())) for fn in lambdas
    ):
        return "scheduler.lr_lambdas: not the schedule's settings (integers)"
    if len(lambdas) > len(state["base_lrs"]):
        return "scheduler.lr_lambdas: more schedules than learning rates"
    return None


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(_count(v) for v in value)


def _mixture_problem(state: dict[str, Any]) -> str | None:
    """A mixture's position (trainer.data.sampler.MixtureSampler, with the pipeline's counts)."""
    sources = state.get("sources")
    if not (isinstance(sources, list) and sources) or not all(
        isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and _count(s[1]) and isinstance(s[2], str)
        for s in sources
    ):
        return "sampler.sources: not the mixture's sources (name, rows, share)"
    for key in ("drawn", "tokens_drawn"):
        if key in state and not (_counts(state[key]) and len(state[key]) == len(sources)):
            return f"sampler.{key}: not a count per source"
    if not _count(state.get("offset")) or "drawn" not in state:
        return "sampler.offset: not a count"
    splits = state.get("eval_split")
    if splits is not None and not (
        isinstance(splits, list)
        and len(splits) == len(sources)
        and all(s is None or isinstance(s, dict) for s in splits)
    ):
        return "sampler.eval_split: not the record of each source's held-out split"
    return None


def _sampler_problem(state: Any) -> str | None:
    if not isinstance(state, dict):
        return "sampler: not the sampler's position"
    if not is_int(state.get("seed")):
        return "sampler.seed: not an integer"
    if "sources" in state:
        return _mixture_problem(state)
    for key in ("epoch", "offset", "num_rows"):
        if not _count(state.get(key)):
            return f"sampler.{key}: not a count"
    if state.get("eval_split") is not None and not isinstance(state["eval_split"], dict):
        return "sampler.eval_split: not the record of a held-out split"
    return None


def _evals_problem(state: Any) -> str | None:
    if state is None:
        return None
    evals = state.get("evals", []) if isinstance(state, dict) else None
    if not isinstance(evals, list) or not all(
        isinstance(e, list) and len(e) == 2 and _count(e[0]) and is_number(e[1]) for e in evals
    ):
        return "evals: not a history of [step, eval loss]"
    return None


def _batch_problem(state: Any) -> str | None:
    if state is None:
        return None
    keys = ("micro_batch_size", "grad_accum", "world_size", "global_batch")
    if not isinstance(state, dict) or not all(
        state.get(key) is None or (is_int(state[key]) and state[key] >= 1) for key in keys
    ):
        return "batch: not the shape of a global batch"
    return None


def trainer_state_problem(state: Any, *, partial: bool = False) -> str | None:
    """What is wrong with ``state`` as the trainer state of a checkpoint (what
    trainer.loop.Trainer.state_dict writes and load_state_dict reads), or None. ``partial``
    (a memory snapshot's, which a caller may take of part of the state): the keys that are
    there are checked, none is required but ``step``."""
    if not isinstance(state, dict):
        return "not the trainer's state (an object with step, tokens_seen, sampler, scheduler ...)"
    for key in ("step", "tokens_seen", "target_tokens_seen"):
        if not _count(state.get(key)) and not (partial and key != "step" and key not in state):
            return f"{key}: not a count"
    for key in ("seed", "world_size"):
        if state.get(key) is not None and not is_int(state[key]):
            return f"{key}: not an integer"
    if state.get("saved_at") is not None and not is_number(state["saved_at"]):
        return "saved_at: not a time"
    parts = {"sampler": _sampler_problem, "scheduler": _scheduler_problem, "batch": _batch_problem}
    parts["evals"] = _evals_problem
    for key, problem in parts.items():
        if partial and key not in state:
            continue
        found = problem(state.get(key))
        if found is not None:
            return found
    return None


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state in ``path`` (``trainer_state.json``): a regular file of at most 64 MiB
    (jobgen.base.safe_read), JSON of the types :func:`trainer_state_problem` checks.
    :class:`UnreadableCheckpoint` naming the file otherwise."""
    try:
        state = parse_json(path, read_file(path, SMALL_FILE))
    except FileNotFoundError as exc:
        raise UnreadableCheckpoint(f"cannot read {path}: {exc.strerror or exc}") from None
    except DamagedFile as exc:  # not JSON
        raise UnreadableCheckpoint(f"cannot read {exc}") from None
    problem = trainer_state_problem(state)
    if problem is not None:
        raise UnreadableCheckpoint(f"cannot read {path}: {problem}")
    return state
