"""Write Hugging Face safetensors shards tensor by tensor, never holding the whole model.

An export reads from a torch.distributed.checkpoint (DCP) directory, or from the base
model's safetensors when LoRA adapters are merged, and writes
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``, the layout
``from_pretrained`` reads. Memory stays bounded by the read batch, not the model:

1. Every tensor's name, shape and dtype are known before anything is read (the DCP
   ``.metadata``, the safetensors headers), so the shards are planned up front and each
   file's header, which holds every offset, is written before its first tensor.
2. Tensors are then read in batches of at most ``batch_bytes`` (one DCP load per batch,
   which reads only the requested tensors, whatever world size or parallelism wrote them),
   converted, appended to the open shard and dropped.

The format is written here rather than with ``safetensors.torch.save_file`` because that
takes a whole shard's tensors at once: memory would be the shard size (2 GiB by default),
not the batch. What is written is what ``save_file`` writes (8-byte header length, a JSON
header with ``{"format": "pt"}`` metadata padded to 8 bytes, then the raw little-endian
data) and ``safetensors`` itself reads it back.

This module knows the file formats only; which tensors an export holds, and under which
names, is trainer.checkpoints.export's decision.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.checkpoints.reader import CheckpointReader, load

MAX_SHARD_BYTES = 2 * 1024**3  # per safetensors file, as written (the export dtype)
READ_BATCH_BYTES = 256 * 1024**2  # held at once while reading: the export's memory beyond the interpreter
WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the output: its name there, shape and dtype as written, and
    ``read_bytes``, what else is held while it is read and converted (the source tensor,
    a float32 copy for arithmetic)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    @property
    def cost(self) -> int:
        return self.nbytes + self.read_bytes


# Reads the tensors of one batch: name -> tensor of the plan's shape and dtype.
ReadBatch = Callable[[list[TensorPlan]], Mapping[str, torch.Tensor]]


def plan_shards(tensors: Sequence[TensorPlan], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[TensorPlan]]:
    """Consecutive tensors into shards of at most ``max_shard_bytes`` (a larger tensor gets
    a shard of its own), in the order given: the order of the files' contents."""
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in tensors:
        if shards[-1] and size + plan.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += plan.nbytes
    return [shard for shard in shards if shard]


def batches(tensors: Sequence[TensorPlan], batch_bytes: int = READ_BATCH_BYTES) -> Iterator[list[TensorPlan]]:
    """Consecutive tensors whose read costs add up to at most ``batch_bytes`` (or one tensor)."""
    batch: list[TensorPlan] = []
    size = 0
    for plan in tensors:
        if batch and size + plan.cost > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(plan)
        size += plan.cost
    if batch:
        yield batch


def _header(tensors: Sequence[TensorPlan]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for plan in tensors:
        if plan.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{plan.name}: dtype {plan.dtype} has no safetensors name")
        end = offset + plan.nbytes
        entries[plan.name] = {
            "dtype": _DTYPE_NAMES[plan.dtype],
            "shape": list(plan.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as stored on this (little-endian) machine, without a copy when it
    is contiguous already."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(
    path: Path, tensors: Sequence[TensorPlan], read: ReadBatch, *, batch_bytes: int = READ_BATCH_BYTES
) -> None:
    """One safetensors file: the header from the plan, then each batch as it is read.
    The file is fsynced; a read or write that fails leaves it partial for the caller to drop."""
    assert sys.byteorder == "little", "safetensors data is little-endian"
    with open(path, "wb") as fh:
        fh.write(_header(tensors))
        for batch in batches(tensors, batch_bytes):
            got = dict(read(batch))
            for plan in batch:
                tensor = got.pop(plan.name)
                if tuple(tensor.shape) != plan.shape or tensor.dtype != plan.dtype:
                    raise ValueError(
                        f"{plan.name}: read {tuple(tensor.shape)} {tensor.dtype}, planned {plan.shape} {plan.dtype}"
                    )
                fh.write(_raw(tensor))
                del tensor
        fh.flush()
        os.fsync(fh.fileno())


def write_sharded(
    directory: Path,
    tensors: Sequence[TensorPlan],
    read: ReadBatch,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    batch_bytes: int = READ_BATCH_BYTES,
) -> dict[str, object]:
    """``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json`` in
    ``directory``; returns the index. The index is always written, one shard or many."""
    names = [plan.name for plan in tensors]
    if len(set(names)) != len(names):
        raise ValueError("an export names a tensor twice")
    shards = plan_shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / filename, shard, read, batch_bytes=batch_bytes)
        weight_map.update(dict.fromkeys((plan.name for plan in shard), filename))
    index = {"metadata": {"total_size": sum(plan.nbytes for plan in tensors)}, "weight_map": weight_map}
    with open(directory / WEIGHTS_INDEX, "w") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return index


class DcpTensors:
    """Chosen tensors of a DCP checkpoint, read in batches without a process group.

    The ``.metadata`` is read once (it lists every tensor's global shape and dtype); each
    :meth:`read` is one ``dcp.load`` of just the keys asked for, which DCP assembles from
    whichever ranks' shards hold them. Both through trainer.checkpoints.reader: nothing the
    checkpoint holds runs (trainer.checkpoints.reader.UnreadableCheckpoint otherwise)."""

    def __init__(self, path: Path):
        self.path = path
        self._reader = CheckpointReader(path)  # keeps the metadata for every read
        metadata = self._reader.metadata()
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            key: (tuple(item.size), item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors stored under ``keys`` (flattened names such as ``model.lm_head.weight``),
        in the checkpoint's dtype."""
        state = {key: torch.empty(self.tensors[key][0], dtype=self.tensors[key][1]) for key in keys}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            load(state, self.path, reader=self._reader, no_dist=True)
        return state


class SafetensorsModel:
    """The weights of a Hugging Face model directory (``model.safetensors``, or shards
    listed by ``model.safetensors.index.json``), read tensor by tensor.

    Only the headers are read up front. Files are opened per batch and closed after it: a
    safetensors file is memory-mapped, and its pages read stay in the process's RSS for as
    long as it is open."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / WEIGHTS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
        elif (directory / SINGLE_WEIGHTS).is_file():
            files = [SINGLE_WEIGHTS]
        else:
            raise FileNotFoundError(f"{directory} has no {SINGLE_WEIGHTS} or {WEIGHTS_INDEX}")
        self.directory = directory
        self.files: dict[str, str] = {}  # tensor name -> file name, in the files' order
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for filename in files:
            with safe_open(str(directory / filename), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                    view = fh.get_slice(name)
                    dtype = view.get_dtype()
                    if dtype not in _DTYPES:
                        raise ValueError(f"{directory / filename}: {name} has dtype {dtype}, not read here")
                    self.tensors[name] = (tuple(view.get_shape()), _DTYPES[dtype])
                    self.files[name] = filename

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        out = {}
        for filename, wanted in by_file.items():
            with safe_open(str(self.directory / filename), framework="pt") as fh:
                for name in wanted:
                    out[name] = fh.get_tensor(name)  # a copy: it outlives the mapping
        return out
