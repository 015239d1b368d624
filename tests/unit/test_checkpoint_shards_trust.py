"""A checkpoint's files are read as untrusted input (issue 45): nothing in them makes a reader
wait, allocate what a file only claims, decompress, or restore a state the trainer never wrote.

- A ``.distcp`` shard (or the ``.metadata``) that is a FIFO is refused in one line at once, where
  the open used to wait forever; one that is a link to ``/dev/zero`` with 1 GiB claimed for it in
  the metadata is refused before any of it is allocated (run with an address-space limit,
  tests/bounded.py).
- A storage range of the metadata that lies past its shard's end (or is no range), a
  transform (zstd) the trainer never writes, and an item whose zip record is compressed
  (torch.load would inflate it) are refused naming the file.
- On resume (a real Checkpointer in a world of one, as tests/unit/test_checkpoint_prune.py runs
  it), a wrong-shaped or unreadable RNG file and a damaged ``trainer_state.json`` make their
  checkpoint one that does not load: it is set aside (``broken-*``, the line in its
  ``broken.json``) and the previous one is resumed, with no traceback, where resume used to
  crash in the restore after the model was loaded (or resume the damaged state)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bounded import bounded
from helpers import REPO
from small_checkpoints import copy_checkpoint, load_into_zeros, save_checkpoint

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint as the trainer writes one (tests/small_checkpoints.py)."""
    return save_checkpoint(tmp_path_factory.mktemp("dcp"))


def _copy(saved, tmp_path: Path) -> Path:
    return copy_checkpoint(saved, tmp_path)


def _load(path: Path, like: dict) -> str:
    load_into_zeros(path, like)
    return "loaded"


def _shard(checkpoint: Path) -> Path:
    return sorted(checkpoint.glob("*.distcp"))[0]


def _rewrite_storage(checkpoint: Path, shard: str, *, only_bytes: bool = False, **changes) -> None:
    """The checkpoint's .metadata with ``changes`` to every storage entry of ``shard`` (only its
    non-tensor items with ``only_bytes``: the ones DCP reads whole into memory)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from trainer.checkpoints.reader import read_metadata_file

    meta = read_metadata_file(checkpoint / ".metadata")
    for index, info in list(meta.storage_data.items()):
        is_bytes = isinstance(meta.state_dict_metadata[index.fqn], BytesStorageMetadata)
        if info.relative_path == shard and (is_bytes or not only_bytes):
            meta.storage_data[index] = dataclasses.replace(info, **changes)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(meta))


def _assert_refused_one_line(outcome, path: Path, *words: str) -> None:
    assert not outcome.hung, "the reader waited on the file"
    assert outcome.error_type == "CheckpointRefused", outcome
    assert "MemoryError" not in outcome.traceback, outcome.traceback
    assert "\n" not in outcome.error and outcome.error.startswith(f"refusing to load {path}: "), outcome.error
    for word in words:
        assert word in outcome.error, outcome.error


# ---------------------------------------------------------------- files that are not files


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["shard", ".metadata"])
def test_a_fifo_in_a_checkpoint_is_refused_at_once(saved, tmp_path, which):
    checkpoint = _copy(saved, tmp_path)
    fifo = _shard(checkpoint) if which == "shard" else checkpoint / ".metadata"
    if which == "shard":
        _rewrite_storage(checkpoint, fifo.name)  # the metadata stays DCP's own, read before the FIFO goes in
    fifo.unlink()
    os.mkfifo(fifo)
    outcome = bounded(lambda: _load(checkpoint, saved[1]), seconds=15)
    _assert_refused_one_line(outcome, fifo, "FIFO")


@pytest.mark.timeout(60)
def test_a_shard_linked_to_dev_zero_with_a_gib_claimed_is_refused_before_allocating_it(saved, tmp_path):
    """The optimizer's settings (non-tensor items, which DCP reads whole into memory) moved to a
    shard that is a link to /dev/zero, 1 GiB each as the metadata says: with 256 MiB of address
    space to spare, reading one would end in MemoryError, a larger length would exhaust the node."""
    checkpoint = _copy(saved, tmp_path)
    shard = checkpoint / "__1_0.distcp"
    _rewrite_storage(checkpoint, _shard(checkpoint).name, only_bytes=True, relative_path=shard.name, length=1 << 30)
    shard.symlink_to("/dev/zero")
    outcome = bounded(lambda: _load(checkpoint, saved[1]), seconds=20, extra_bytes=256 << 20)
    _assert_refused_one_line(outcome, shard, "symbolic link")


# ---------------------------------------------------------------- what the metadata claims


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["length past the end", "offset past the end"])
def test_a_storage_range_past_its_shards_end_is_one_line_naming_the_shard(saved, tmp_path, where):
    """As a shard cut short by a full disk reads: the range is checked against the file's size."""
    checkpoint = _copy(saved, tmp_path)
    shard = _shard(checkpoint)
    size = shard.stat().st_size
    change = {"length past the end": {"offset": 0, "length": size + 1}, "offset past the end": {"offset": size + 100}}
    _rewrite_storage(checkpoint, shard.name, **change[where])
    outcome = bounded(lambda: _load(checkpoint, saved[1]), seconds=20)
    assert outcome.error_type == "UnreadableCheckpoint", outcome
    assert "\n" not in outcome.error and outcome.error.startswith(f"cannot read {shard}: "), outcome.error
    assert f"of {size} bytes" in outcome.error, outcome.error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", [{"offset": -8}, {"length": -1}, {"offset": "0"}], ids=["offset", "length", "type"])
def test_a_storage_range_that_is_no_range_is_refused(saved, tmp_path, change):
    checkpoint = _copy(saved, tmp_path)
    shard = _shard(checkpoint)
    _rewrite_storage(checkpoint, shard.name, **change)
    outcome = bounded(lambda: _load(checkpoint, saved[1]), seconds=20)
    _assert_refused_one_line(outcome, checkpoint / ".metadata", shard.name)


@pytest.mark.timeout(60)
def test_a_transform_the_trainer_never_writes_is_refused(saved, tmp_path):
    """zstd (or any transform) in the metadata would decompress what a teammate wrote: a bomb."""
    checkpoint = _copy(saved, tmp_path)
    shard = _shard(checkpoint)
    _rewrite_storage(checkpoint, shard.name, transform_descriptors=["stream.zstd/1"])
    outcome = bounded(lambda: _load(checkpoint, saved[1]), seconds=20)
    _assert_refused_one_line(outcome, checkpoint / ".metadata", "stream.zstd/1", shard.name)


@pytest.mark.timeout(60)
def test_an_item_whose_zip_record_is_compressed_is_refused_before_torch_inflates_it(saved, tmp_path):
    """torch.load inflates a deflated record of an item's zip into a buffer of the size its header
    claims (a record of kilobytes can claim terabytes); torch.save never compresses one."""
    import zipfile

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer.checkpoints.reader import read_metadata_file

    checkpoint = _copy(saved, tmp_path)
    meta = read_metadata_file(checkpoint / ".metadata")
    index, info = next(
        (index, info)
        for index, info in meta.storage_data.items()
        if isinstance(meta.state_dict_metadata[index.fqn], TensorStorageMetadata)
    )
    with open(checkpoint / info.relative_path, "rb") as fh:
        fh.seek(info.offset)
        item = zipfile.ZipFile(io.BytesIO(fh.read(info.length)))
    deflated = io.BytesIO()
    with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as out:
        for record in item.infolist():
            out.writestr(record.filename, item.read(record.filename))
    shard = checkpoint / "__2_0.distcp"
    shard.write_bytes(deflated.getvalue())
    meta.storage_data[index] = dataclasses.replace(
        info, relative_path=shard.name, offset=0, length=shard.stat().st_size
    )
    (checkpoint / ".metadata").write_bytes(pickle.dumps(meta))
    outcome = bounded(lambda: _load(checkpoint, saved[1]), seconds=20)
    _assert_refused_one_line(outcome, shard, "is compressed")


# ---------------------------------------------------------------- resume sets a damaged one aside

# A world of one (gloo), as tests/unit/test_checkpoint_prune.py runs the Checkpointer: two
# checkpoints with the trainer's own state (trainer.loop's state_dict), the newer one damaged,
# then load_latest. argv: the checkpoint root, a free port, the damage.
RESUME = r"""
import os, sys
from pathlib import Path
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
import json, time
import torch
from torch.optim.lr_scheduler import LambdaLR
from trainer.checkpoints import checkpointer as checkpoint
from trainer.distributed import init_distributed, shutdown
from trainer.optim import WarmupCosine

root, damage = Path(sys.argv[1]), sys.argv[3]
env = init_distributed(60, 1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scheduler = LambdaLR(optimizer, WarmupCosine(1, 10))

def trainer_state(step):
    return {
        "step": step, "tokens_seen": 16 * step, "target_tokens_seen": 8 * step,
        "sampler": {"epoch": 0, "offset": 2 * step, "num_rows": 10, "seed": 0},
        "scheduler": scheduler.state_dict(), "seed": 0, "world_size": 1,
        "batch": {"micro_batch_size": 2, "grad_accum": 1, "world_size": 1, "global_batch": 2},
        "saved_at": time.time(), "evals": {"evals": [[step, 2.5]]},
    }

ckpt = checkpoint.Checkpointer(root, env, keep=5, every_steps=0, every_seconds=0)
for step in (1, 2):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    ckpt.save(step, model, optimizer, trainer_state(step))
newer = root / "step-00000002"
rng, state = newer / "rng-rank00000.pt", newer / "trainer_state.json"
if damage.startswith("rng"):
    good = torch.load(rng, weights_only=True)
    rng.unlink()
if damage == "rng: torch is a float tensor of the wrong size":
    torch.save({**good, "torch": torch.zeros(10)}, rng)
elif damage == "rng: a list":
    torch.save([1, 2, 3], rng)
elif damage == "rng: python state out of range":
    torch.save({**good, "python": {**good["python"], "state": torch.full((625,), 2**40, dtype=torch.int64)}}, rng)
elif damage == "rng: a FIFO":
    os.mkfifo(rng)
elif damage == "rng: a link to /dev/zero":
    rng.symlink_to("/dev/zero")
elif damage == "trainer_state: wrong types":
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": "seven"}))
elif damage == "trainer_state: a list":
    state.write_text("[1, 2]")
elif damage == "trainer_state: a scheduler that sets other attributes":
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "scheduler": {**saved["scheduler"], "optimizer": 5}}))
elif damage == "trainer_state: a FIFO":
    state.unlink()
    os.mkfifo(state)

# Every torch.load of a path: the RNG file must never be loaded through a link or a FIFO.
real_load, loaded_paths = torch.load, []
def spy(f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)):
        loaded_paths.append(str(f))
    return real_load(f, *args, **kwargs)
torch.load = spy

found = ckpt.load_latest(model, optimizer)
shutdown()
broken = [p for p in root.iterdir() if p.name.startswith("broken-")]
print(json.dumps({
    "loaded": found[1].name if found else None,
    "step": (found[0].get("step") if isinstance(found[0], dict) else repr(found[0])) if found else None,
    "broken": [p.name for p in broken],
    "errors": json.loads((broken[0] / "broken.json").read_text())["errors"] if broken else None,
    "paths_loaded": loaded_paths,
    "latest": (root / "latest").read_text().strip(),
}))
"""

DAMAGES = {
    "rng: torch is a float tensor of the wrong size": "rng-rank00000.pt",
    "rng: a list": "rng-rank00000.pt",
    "rng: python state out of range": "rng-rank00000.pt",
    "rng: a FIFO": "rng-rank00000.pt",
    "rng: a link to /dev/zero": "rng-rank00000.pt",
    "trainer_state: wrong types": "trainer_state.json",
    "trainer_state: a list": "trainer_state.json",
    "trainer_state: a scheduler that sets other attributes": "trainer_state.json",
    "trainer_state: a FIFO": "trainer_state.json",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_rng_or_trainer_state_is_set_aside_and_the_previous_checkpoint_resumed(tmp_path, damage):
    root = tmp_path / "checkpoints"
    proc = subprocess.run(
        [sys.executable, "-c", RESUME, str(root), str(_free_port()), damage],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == "step-00000001" and result["step"] == 1, result
    assert result["latest"] == "step-00000001", result
    assert len(result["broken"]) == 1 and result["broken"][0].startswith("broken-step-00000002-"), result
    (error,) = result["errors"]
    assert "\n" not in error and f"step-00000002/{DAMAGES[damage]}" in error, error
    assert not any("rng-rank" in path for path in result["paths_loaded"]), result["paths_loaded"]
