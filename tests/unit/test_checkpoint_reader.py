"""trainer.checkpoints.reader: a DCP checkpoint is read without running anything it holds.

A real checkpoint (a model and its AdamW state, saved by DCP's own writer in this process)
loads whole through the reader; a ``.metadata`` or a non-tensor item with a planted global
is refused with one line naming the file and the global, and its payload never runs. The
kinds the trainer writes (FSDP, pipeline, LoRA, optimizer in backward) load through the same
reader in tests/distributed/test_planted_checkpoints.py."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest

from planted import _System, command, metadata_payload, plant_item, plant_metadata
from small_checkpoints import copy_checkpoint, load_into_zeros, save_checkpoint

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint as the trainer writes one: {"model", "optim"} by get_state_dict, after a step."""
    return save_checkpoint(tmp_path_factory.mktemp("dcp"))


def _copy(saved, tmp_path: Path) -> Path:
    return copy_checkpoint(saved, tmp_path)


_load = load_into_zeros


def test_a_real_checkpoint_loads_whole(saved):
    import torch

    path, state = saved
    got = _load(path, state)
    for key, tensor in state["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    assert got["optim"]["param_groups"][0]["lr"] == 0.25
    assert tuple(got["optim"]["param_groups"][0]["betas"]) == (0.8, 0.9)  # non-tensor items, weights-only
    for key, entry in state["optim"]["state"].items():
        assert torch.equal(got["optim"]["state"][key]["exp_avg"], entry["exp_avg"]), key


def test_the_metadata_reads_with_only_what_dcp_writes(saved):
    from torch.distributed.checkpoint.metadata import Metadata

    from trainer.checkpoints.reader import read_metadata_file

    found = read_metadata_file(saved[0] / ".metadata")
    assert isinstance(found, Metadata) and "model.0.weight" in found.state_dict_metadata


def _warnings(caplog) -> list[logging.LogRecord]:
    """Warnings a user would see: torch's c10d loggers have only a NullHandler and do not propagate."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING and not r.name.startswith("c10d-")]


class _Exec:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def _stack_global(marker: Path) -> bytes:
    return pickle.dumps(_System(command(marker)), protocol=4)  # STACK_GLOBAL posix system


def _exec(marker: Path) -> bytes:
    return pickle.dumps(_Exec(f"open({str(marker)!r}, 'w').close()"), protocol=3)  # GLOBAL builtins exec


@pytest.mark.parametrize(
    "payload, asks_for",
    [(metadata_payload, "os.system"), (_stack_global, "posix.system"), (_exec, "builtins.exec")],
    ids=["GLOBAL", "STACK_GLOBAL", "exec"],
)
def test_a_planted_metadata_is_refused_by_name_and_never_runs(saved, tmp_path, caplog, payload, asks_for):
    from trainer.checkpoints.reader import CheckpointRefused

    checkpoint = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(payload(marker))
    with caplog.at_level(logging.DEBUG), pytest.raises(CheckpointRefused) as info:
        _load(checkpoint, saved[1])
    assert str(info.value) == f"refusing to load {checkpoint}/.metadata: it asks for {asks_for}"
    assert not marker.exists()
    # DCP logs (with a traceback) any ordinary error of a reader's metadata and reads other files.
    assert not _warnings(caplog), caplog.text


def test_a_planted_item_in_a_shard_is_refused_by_name_and_never_runs(saved, tmp_path):
    from trainer.checkpoints.reader import CheckpointRefused

    checkpoint = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    key = plant_item(checkpoint, marker)
    with pytest.raises(CheckpointRefused) as info:
        _load(checkpoint, saved[1])
    message = str(info.value)
    assert message.startswith(f"refusing to load {checkpoint}/__0_") and ".distcp (item " in message, message
    assert f"(item {key}): it asks for posix.system" in message, message
    assert not marker.exists()


def test_a_pickle_that_sets_attributes_of_a_class_is_refused(saved, tmp_path):
    """BUILD on a class object (which the C unpickler allows) would change it for the process."""
    from torch.distributed.checkpoint.metadata import Metadata

    from trainer.checkpoints.reader import CheckpointRefused, read_metadata_file

    path = tmp_path / ".metadata"
    # GLOBAL Metadata, then (None, {"version": "x"}) as state, BUILD: setattr(Metadata, "version", "x").
    path.write_bytes(
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x07\x00\x00\x00versionX\x01\x00\x00\x00xs\x86b."
    )
    before = Metadata.__dict__.get("version")
    with pytest.raises(CheckpointRefused, match="it sets attributes of Metadata"):
        read_metadata_file(path)
    assert Metadata.__dict__.get("version") == before


def test_a_metadata_naming_a_file_outside_its_checkpoint_is_refused(saved, tmp_path):
    import dataclasses

    from trainer.checkpoints.reader import CheckpointRefused, read_metadata_file

    checkpoint = _copy(saved, tmp_path)
    meta = read_metadata_file(checkpoint / ".metadata")
    index = next(iter(meta.storage_data))
    meta.storage_data[index] = dataclasses.replace(meta.storage_data[index], relative_path="../../etc/passwd")
    (checkpoint / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointRefused, match=r"it names '../../etc/passwd', not a file of its checkpoint"):
        _load(checkpoint, saved[1])


@pytest.mark.parametrize("damage", ["truncated", "missing", "not metadata"])
def test_a_damaged_metadata_is_one_line_naming_it(saved, tmp_path, caplog, damage):
    from trainer.checkpoints.reader import CheckpointRefused, UnreadableCheckpoint

    checkpoint = _copy(saved, tmp_path)
    metadata = checkpoint / ".metadata"
    if damage == "truncated":
        metadata.write_bytes(metadata.read_bytes()[:100])
    elif damage == "missing":
        metadata.unlink()
    else:
        metadata.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with caplog.at_level(logging.DEBUG), pytest.raises(UnreadableCheckpoint) as info:
        _load(checkpoint, saved[1])
    assert not isinstance(info.value, CheckpointRefused)
    assert str(info.value).startswith(f"cannot read {metadata}: ") and "\n" not in str(info.value)
    assert not _warnings(caplog), caplog.text


def test_the_trainers_one_line_for_a_refusal_is_the_refusal(saved, tmp_path):
    """What resume logs and writes to broken.json, and export reports."""
    from trainer.checkpoints.checkpointer import describe_load_error

    checkpoint = _copy(saved, tmp_path)
    plant_metadata(checkpoint, tmp_path / "pwned")
    with pytest.raises(BaseException) as info:
        _load(checkpoint, saved[1])
    assert describe_load_error(info.value) == f"refusing to load {checkpoint}/.metadata: it asks for os.system"
    assert not os.path.exists(tmp_path / "pwned")


class _EnumsByName(pickle.Pickler):
    """pickle as Python 3.11.0-3.11.4 and 3.12.0 write an enum member (Debian bookworm's python3
    is 3.11.2): a call of builtins.getattr with its class and its name."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_a_metadata_written_by_python_3_11_2_loads(saved, tmp_path):
    """Found by the first run in Debian's image (docs/containers.md): every checkpoint it wrote
    was refused as asking for builtins.getattr, and no task could resume."""
    import io

    from trainer.checkpoints.reader import read_metadata_file

    original = read_metadata_file(saved[0] / ".metadata")
    out = io.BytesIO()
    _EnumsByName(out, protocol=4).dump(original)
    assert b"getattr" in out.getvalue()
    (tmp_path / ".metadata").write_bytes(out.getvalue())
    found = read_metadata_file(tmp_path / ".metadata")
    assert found.state_dict_metadata == original.state_dict_metadata


@pytest.mark.parametrize("target", ["class-attribute", "not-a-member"])
def test_getattr_is_only_an_enum_members_lookup(tmp_path, target):
    from torch.distributed.checkpoint import metadata

    from trainer.checkpoints.reader import CheckpointRefused, read_metadata_file

    cls, name = {
        "class-attribute": (metadata.Metadata, "__init__"),
        "not-a-member": (metadata._MEM_FORMAT_ENCODING, "mro"),
    }[target]

    class _Lookup:
        def __reduce__(self):
            return getattr, (cls, name)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Lookup(), protocol=4))
    with pytest.raises(CheckpointRefused, match=r"it asks for getattr\("):
        read_metadata_file(tmp_path / ".metadata")
