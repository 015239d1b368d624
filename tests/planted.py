"""Checkpoints with a planted pickle: what a teammate who can write a run's checkpoints could
leave there for whoever resumes, exports or serves it. Each payload creates ``marker`` when
it is unpickled; a test asserts the marker never appears.

- ``metadata_payload``: a ``.metadata`` whose pickle calls ``os.system`` (by ``GLOBAL os system``,
  the spelling the refusal names).
- ``plant_metadata``: that file as a checkpoint's ``.metadata``.
- ``plant_item``: a non-tensor item of a ``.distcp`` shard (an optimizer hyperparameter) that
  ``torch.save``d an object reducing to ``os.system``; the ``.metadata`` stays DCP's own and
  points the item at it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path


def command(marker: Path) -> str:
    return f"touch {marker}"


def metadata_payload(marker: Path) -> bytes:
    """Protocol 0, written out: ``os.system("touch MARKER")``."""
    return b"cos\nsystem\n(V" + command(marker).encode("raw_unicode_escape") + b"\ntR."


def plant_metadata(checkpoint: Path, marker: Path) -> Path:
    target = checkpoint / ".metadata"
    target.write_bytes(metadata_payload(marker))
    return target


class _System:
    """Unpickles as a call of os.system (what torch.load(weights_only=False) runs)."""

    def __init__(self, line: str):
        self.line = line

    def __reduce__(self):
        return (os.system, (self.line,))


def plant_item(checkpoint: Path, marker: Path) -> str:
    """Replace the first non-tensor item of ``checkpoint`` with a torch.save of os.system;
    returns the item's key."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(checkpoint / ".metadata", "rb") as fh:
        meta = pickle.load(fh)  # the test's own checkpoint, before anything is planted
    index = next(i for i in meta.storage_data if isinstance(meta.state_dict_metadata[i.fqn], BytesStorageMetadata))
    info = meta.storage_data[index]
    buffer = io.BytesIO()
    torch.save(_System(command(marker)), buffer)
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as fh:
        fh.write(buffer.getvalue())
    meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    with open(checkpoint / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)
    return index.fqn
