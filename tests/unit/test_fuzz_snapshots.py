"""Fuzzing the memory snapshot reader (issue 45): a snapshot file on a node's tmpfs, or one the
mirror sent, may be damaged or planted, and whatever it holds, a relaunching rank either takes
it as a snapshot its model, optimizer and RNG streams can be restored from, or refuses it with
one :class:`UnusableSnapshot` line (and resumes from disk): never another exception, a signal,
a hang or a MemoryError, and never a line of code the file names.

From a valid snapshot written by the real code (:class:`Snapshots.take` of a tiny model and its
AdamW state after a step, as tests/unit/test_snapshot_trust.py takes one), each case damages it
with seeded mutations: bytes flipped anywhere, in the pickle or in the zip's directory; the
file cut short, garbage or a second archive appended, a range zeroed or bytes inserted, the
file grown (sparse) past the size a snapshot of this state may take; a zip member rewritten
with other bytes, removed, doubled or compressed, a size, offset or method in the directory or
a local header edited; the payload saved again with a node replaced (tensors of another dtype,
shape, layout or device, views, plain values of other types, containers of other lengths, keys
removed or added, the trainer's JSON state edited), or ``data.pkl`` replaced by a plain pickle
of another structure; a global planted (``os.system``, ``exec``, ``subprocess.call``,
``Path.touch``) that would create a marker file if it ever ran.

Each case runs in :func:`bounded.bounded` (a forked child, 20 s and 512 MiB of address space
beyond the parent's) through what a relaunch does with one rank's file: ``read_snapshot`` then
``checked_snapshot``. A snapshot taken is then restored as Snapshots.restore would: its tensors
checked independently (same keys, lengths, shapes, dtypes, plain CPU tensors, plain values of
the same kind) and copied into this launch's, its RNG streams set, its trainer state the
object of its step.

The run stops after :data:`CASES` cases or :data:`SECONDS` seconds, whichever comes first; the
cases are the same for the same seed. To fuzz longer::

    JOBGEN_FUZZ_SECONDS=600 JOBGEN_FUZZ_SEED=7 .venv/bin/python -m pytest -n 0 tests/unit/test_fuzz_snapshots.py

(``JOBGEN_FUZZ_SECONDS`` lifts the case count too). A failing case is named by its number and
its mutations; ``JOBGEN_FUZZ_SEED`` and the number make it again (:func:`make_case`).
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import random
import struct
import subprocess
import time
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bounded import Outcome, bounded
from small_checkpoints import trainer_state

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from jobgen.base.visible import visible  # noqa: E402
from trainer.checkpoints.checkpointer import state_dict_options  # noqa: E402
from trainer.checkpoints.snapshot_checks import (  # noqa: E402
    UnusableSnapshot,
    checked_snapshot,
    file_limit,
    read_snapshot,
)
from trainer.checkpoints.state_files import set_rng_state  # noqa: E402

SEED = int(os.environ.get("JOBGEN_FUZZ_SEED", "45"))
SECONDS = float(os.environ.get("JOBGEN_FUZZ_SECONDS", "8"))
CASES = 10**9 if "JOBGEN_FUZZ_SECONDS" in os.environ else 200
CASE_SECONDS = 20  # what one case may take: a reader that needs more hangs
STEP = 4
TRAINER_STATE = trainer_state(STEP)
# Values a size, an offset or a length in the zip takes: the edges of its field, and near them.
EDGES = (0, 1, 2, 63, 64, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF)


@dataclass(frozen=True)
class Valid:
    """The valid snapshot every case starts from: its bytes and payload, where each zip member's
    data lies in them, the state of this launch it is checked against and the marker file a
    planted global would create."""

    data: bytes
    payload: dict[str, Any]
    members: dict[str, tuple[int, int]]  # name -> (offset of its data, its size)
    directory: int  # where the zip's central directory starts
    model_sd: Any
    optim_sd: Any
    limit: int
    marker: Path


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Valid:
    """A snapshot of step STEP taken by a real Snapshots (test_snapshot_trust.py's), of a model
    and its AdamW state after a step, with the trainer's state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer.checkpoints.snapshots import Snapshots
    from trainer.distributed import DistEnv

    root = tmp_path_factory.mktemp("fuzz-snapshot")
    (root / "shm").mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.25)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURMD_NODENAME", "node1")
        snapshots = Snapshots(root / "shm" / f"jobgen-{os.getuid()}" / "run" / "7.0", env, every_steps=STEP)
        snapshots.take(STEP, model, optimizer, TRAINER_STATE)
        snapshots.close()
        data = snapshots.file(0, STEP).read_bytes()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
    archive = zipfile.ZipFile(io.BytesIO(data))
    members = {}
    for info in archive.infolist():
        name_size, extra_size = struct.unpack_from("<HH", data, info.header_offset + 26)
        members[info.filename] = (info.header_offset + 30 + name_size + extra_size, info.file_size)
    return Valid(
        data=data,
        payload=torch.load(io.BytesIO(data), weights_only=True),
        members=members,
        directory=struct.unpack_from("<I", data, data.rindex(b"PK\x05\x06") + 16)[0],
        model_sd=model_sd,
        optim_sd=optim_sd,
        limit=file_limit(model_sd, optim_sd),
        marker=root / "planted-code-ran",
    )


# --------------------------------------------------------------------------- planted code


class Planted:
    """Pickles as a call that creates ``marker``: what would run if the file were unpickled."""

    def __init__(self, marker: Path, how: str):
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "os.system":
            return (os.system, (f"touch {self.marker}",))
        if self.how == "exec":
            return (exec, (f"open({str(self.marker)!r}, 'w').close()",))
        if self.how == "subprocess.call":
            return (subprocess.call, (["touch", str(self.marker)],))
        return (Path.touch, (self.marker,))


PLANTS = ("os.system", "exec", "subprocess.call", "Path.touch")


# --------------------------------------------------------------------------- the payload, saved again


def _tensor_like(rng: random.Random, old: Any) -> Any:
    """A tensor where ``old`` was: another dtype, shape, layout or device, or the same shape as a
    view (transposed, expanded, at an offset), or values no training makes."""
    shape = tuple(old.shape) if isinstance(old, torch.Tensor) and old.dim() else (3,)
    numel = max(1, int(torch.Size(shape).numel()))
    dtype = old.dtype if isinstance(old, torch.Tensor) else torch.float32
    makers = {
        "another dtype": lambda: torch.zeros(shape, dtype=rng.choice([torch.float64, torch.float16, torch.int64])),
        "bool or complex": lambda: torch.zeros(shape, dtype=rng.choice([torch.bool, torch.complex64, torch.uint8])),
        "one more element": lambda: torch.zeros((*shape[:-1], shape[-1] + 1), dtype=dtype),
        "one more dimension": lambda: torch.zeros((1, *shape), dtype=dtype),
        "a scalar": lambda: torch.tensor(1, dtype=dtype),
        "no elements": lambda: torch.zeros((0, *shape[1:]), dtype=dtype),
        "on the meta device": lambda: torch.empty(shape, dtype=dtype, device="meta"),
        "sparse": lambda: torch.zeros(shape, dtype=dtype).to_sparse(),
        "a parameter": lambda: torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False),
        "transposed": lambda: torch.zeros(tuple(reversed(shape)), dtype=dtype).t() if len(shape) == 2 else old,
        "expanded": lambda: torch.zeros((1, *shape[1:]), dtype=dtype).expand(shape),
        "at an offset": lambda: torch.zeros(numel + 7, dtype=dtype)[7:].view(shape),
        "nan and inf": lambda: torch.full(shape, float(rng.choice(["nan", "inf", "-inf"]))).to(dtype),
    }
    what = rng.choice(sorted(makers))
    return makers[what](), what


def _plain_other(rng: random.Random, marker: Path) -> tuple[Any, str]:
    """A value of another kind than a snapshot holds there."""
    deep: Any = 0
    for _ in range(300):
        deep = [deep]
    values = [
        0, -1, 2**63, 2**70, True, None, 0.5, float("nan"), "", "x\x1b[2J\nno", b"bytes", [], [1, 2], (), (1, "a"),
        {}, {"a": 1}, {1: 2}, {(1, 2): 3}, torch.Size([3]), torch.float32, torch.device("cpu"),
        OrderedDict(a=1), complex(1, 2), {1}, frozenset(), deep, bytearray(b"ab"), slice(1, 2), range(3),
    ]  # fmt: skip
    if rng.random() < 0.15:
        how = rng.choice(PLANTS)
        return Planted(marker, how), f"a planted {how}"
    value = rng.choice(values)
    return value, f"a {type(value).__name__} ({visible(repr(value))[:40]})"


def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
    """The path of every node under ``value`` (dict keys, list indices), ``value``'s own first."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _nodes(item, (*path, key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found += _nodes(item, (*path, i))
    return found


def _copy(value: Any) -> Any:
    """A copy of the containers of ``value`` (tuples as lists: they are edited), tensors shared."""
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(item) for item in value]
    return value


def _edit_trainer_state(rng: random.Random, text: str) -> tuple[Any, str]:
    """The trainer's JSON state with one value changed, a key removed or added, or not JSON."""
    state = json.loads(text)
    path = rng.choice(_nodes(state)[1:])
    *head, last = path
    parent = state
    for key in head:
        parent = parent[key]
    what = rng.choice(["replaced", "removed", "added", "text"])
    if what == "text":
        return rng.choice(["[1", "", "1e999999", "[" * 100_000 + "]" * 100_000, text[: len(text) // 2], 7]), "no JSON"
    if what == "removed" and isinstance(parent, dict):
        del parent[last]
    elif what == "added" and isinstance(parent, dict):
        parent[rng.choice(["optimizer", "step", "extra", ""])] = rng.choice([5, None, "x"])
    else:
        parent[last] = rng.choice([-1, 2**70, 1.5, "x", None, True, [], {}, [[1]], {"a": [1]}, 1e308])
    return json.dumps(state), f"trainer_state {list(path)} {what}"


def _edited_node(rng: random.Random, payload: Any, path: tuple, marker: Path) -> tuple[Any, str]:
    """``payload`` with the node at ``path`` replaced (by a tensor or a value of another kind), or
    removed from its container, or with a sibling added; what was done."""
    action = rng.choice(["tensor", "tensor", "plain", "remove", "add"])
    new, what = _tensor_like(rng, _at(payload, path)) if action == "tensor" else _plain_other(rng, marker)
    if not path:
        return new, f"the whole payload: {what}"
    parent = _at(payload, path[:-1])
    if action == "remove":
        del parent[path[-1]]
        return payload, f"{list(path)} removed"
    if action == "add" and isinstance(parent, dict):
        parent[rng.choice(["extra", "", 0, 1.5])] = new
        return payload, f"{list(path[:-1])} a key added: {what}"
    if action == "add":
        parent.append(new)
        return payload, f"{list(path[:-1])} appended: {what}"
    parent[path[-1]] = new
    return payload, f"{list(path)} {what}"


def edited_payload(rng: random.Random, valid: Valid) -> tuple[bytes, str]:
    """The payload saved again by torch.save with one node replaced, removed or added, or with
    the trainer's JSON state edited."""
    payload = _copy(valid.payload)
    region = rng.choice(["model", "optim", "optim", "rng", "rng", "trainer_state", "top"])
    if region == "trainer_state":
        payload["trainer_state"], what = _edit_trainer_state(rng, payload["trainer_state"])
    else:
        paths = _nodes(payload[region], (region,)) if region != "top" else [(), *((k,) for k in payload)]
        payload, what = _edited_node(rng, payload, rng.choice(paths), valid.marker)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue(), f"saved again with {what}"


def _at(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


# --------------------------------------------------------------------------- the archive's members


def _members(data: bytes, valid: Valid) -> list[tuple[str, bytes]]:
    """The members of the archive ``data``, or of the valid one where an earlier mutation left
    no archive Python's zipfile reads, or none with a data.pkl."""
    for archive_bytes in (data, valid.data):
        try:
            archive = zipfile.ZipFile(io.BytesIO(archive_bytes))
            members = [(info.filename, archive.read(info)) for info in archive.infolist()]
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError):
            continue
        if any(name.endswith("data.pkl") for name, _ in members):
            return members
    raise AssertionError("the valid snapshot is no archive")


def _zipped(members: list[tuple[str, bytes]], compressed: str = "") -> bytes:
    """``members`` as a zip again (stored, as torch.save writes them; ``compressed`` deflated)."""
    buffer = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w") as archive:
        warnings.simplefilter("ignore")  # a member doubled: "Duplicate name"
        for name, content in members:
            method = zipfile.ZIP_DEFLATED if name == compressed else zipfile.ZIP_STORED
            archive.writestr(zipfile.ZipInfo(name, (2026, 1, 1, 0, 0, 0)), content, compress_type=method)
    return buffer.getvalue()


def _raw_pickle(rng: random.Random, valid: Valid) -> tuple[bytes, str]:
    """A data.pkl that plain pickle wrote: another structure, other types, a planted global, the
    payload whose tensors pickle their storage as bytes (torch.load inside torch.load), or a
    pickle cut short or claiming more bytes than it holds."""
    choices = {
        "the payload without tensors": lambda: {**valid.payload, "model": {}, "optim": {}, "rng": {}},
        "a list": lambda: [1, 2, 3],
        "a snapshot of plain values": lambda: {k: 0 for k in valid.payload},
        "the payload, tensors pickled plainly": lambda: valid.payload,
        "another type": lambda: _plain_other(rng, valid.marker)[0],
        "a planted global": lambda: {**valid.payload, "model": Planted(valid.marker, rng.choice(PLANTS))},
    }
    what = rng.choice(sorted(choices))
    raw = pickle.dumps(choices[what](), protocol=rng.choice([0, 1, 2, 3, 4, 5]))
    if rng.random() < 0.2:
        tails = {"cut short": raw[: len(raw) // 2], "BINBYTES of 2 GiB": raw[:2] + b"B\xff\xff\xff\x7fab."}
        what = rng.choice(sorted(tails))
        raw = tails[what]
    return raw, what


def member_edited(rng: random.Random, data: bytes, valid: Valid) -> tuple[bytes, str]:
    """One member of the archive rewritten (other bytes, another length, none), removed,
    doubled or compressed, or data.pkl replaced by a plain pickle."""
    members = _members(data, valid)
    names = [name for name, _ in members]
    name = rng.choice([n for n in names if n.endswith("data.pkl")] * 3 + names)
    at = names.index(name)
    what = rng.choice(
        ["random bytes", "one byte fewer", "one byte more", "empty", "removed", "doubled", "compressed", "pickle"]
    )
    content = members[at][1]
    if what == "pickle":
        name = next(n for n in names if n.endswith("data.pkl"))
        content, what = _raw_pickle(rng, valid)
        members[names.index(name)] = (name, content)
        what = f"a plain pickle: {what}"
    elif what == "random bytes":
        members[at] = (name, rng.randbytes(len(content)))
    elif what in ("one byte fewer", "one byte more", "empty"):
        members[at] = (name, {"one byte fewer": content[:-1], "one byte more": content + b"\0", "empty": b""}[what])
    elif what == "removed":
        del members[at]
    elif what == "doubled":
        members.insert(at, (name, rng.randbytes(len(content))))
    return _zipped(members, compressed=name if what == "compressed" else ""), f"member {name}: {what}"


# The fields of a zip's records (APPNOTE): (signature, offset in the record, bytes, what).
RECORD_FIELDS = (
    ("PK\x01\x02", 10, 2, "method"),
    ("PK\x01\x02", 20, 4, "compressed size"),
    ("PK\x01\x02", 24, 4, "size"),
    ("PK\x01\x02", 28, 2, "name's length"),
    ("PK\x01\x02", 30, 2, "extra's length"),
    ("PK\x01\x02", 42, 4, "local header's offset"),
    ("PK\x03\x04", 8, 2, "method"),
    ("PK\x03\x04", 18, 4, "compressed size"),
    ("PK\x03\x04", 22, 4, "size"),
    ("PK\x03\x04", 26, 2, "name's length"),
    ("PK\x03\x04", 28, 2, "extra's length"),
    ("PK\x05\x06", 10, 2, "entries"),
    ("PK\x05\x06", 12, 4, "directory's size"),
    ("PK\x05\x06", 16, 4, "directory's offset"),
)


def record_edited(rng: random.Random, data: bytes, valid: Valid) -> tuple[bytes, str]:
    """A field of a zip record edited in place: in a central directory entry or a local header,
    a size, an offset, a length or the method; the end record's count, size or offset."""
    out = bytearray(data)
    signature, offset, size, field = rng.choice(RECORD_FIELDS)
    starts = [i for i in range(len(out)) if out.startswith(signature.encode("latin-1"), i)]
    if not starts or starts[-1] + offset + size > len(out):
        return bytes(out), f"no whole {field} to edit"
    start = rng.choice([i for i in starts if i + offset + size <= len(out)])
    form = "<I" if size == 4 else "<H"
    (old,) = struct.unpack_from(form, out, start + offset)
    new = rng.choice([*EDGES, old + 1, old - 1, old * 2, 8]) % (1 << (8 * size))
    struct.pack_into(form, out, start + offset, new)
    return bytes(out), f"the {field} of the {signature[2:]!r} record at {start}: {old} -> {new}"


# --------------------------------------------------------------------------- the file's bytes


def bytes_damaged(rng: random.Random, data: bytes, valid: Valid) -> tuple[bytes, str]:
    """Bytes flipped (anywhere, in the pickle, in the directory), the file cut, garbage or a
    second archive appended, a range zeroed, bytes inserted."""
    out = bytearray(data)
    pkl = next((span for name, span in valid.members.items() if name.endswith("data.pkl")), (0, len(out)))
    what = rng.choice(["flip", "flip in data.pkl", "flip in the directory", "cut", "append", "zero", "insert"])
    if what.startswith("flip"):
        lo, hi = {"flip": (0, len(out)), "flip in data.pkl": (pkl[0], pkl[0] + pkl[1])}.get(
            what, (valid.directory, len(out))
        )
        hi = min(hi, len(out))
        count = rng.choice([1, 1, 2, 4, 16])
        for _ in range(count if hi > lo else 0):
            out[rng.randrange(lo, hi)] ^= rng.randrange(1, 256)
        what = f"{count} byte(s): {what}"
    elif what == "cut":
        at = rng.choice([0, 4, 30, rng.randrange(max(1, len(out))), len(out) - 22, len(out) - 1])
        del out[max(0, at) :]
        what = f"cut at byte {at}"
    elif what == "append":
        tail = rng.choice([rng.randbytes(rng.choice([1, 22, 4096])), valid.data, b"PK\x05\x06" + bytes(18)])
        out += tail
        what = f"{len(tail)} bytes appended"
    elif what == "zero":
        at, count = rng.randrange(max(1, len(out))), rng.choice([1, 64, 4096])
        out[at : at + count] = bytes(len(out[at : at + count]))
        what = f"{count} bytes zeroed at {at}"
    else:
        at = rng.randrange(max(1, len(out)))
        out[at:at] = rng.randbytes(rng.choice([1, 8, 100]))
        what = f"bytes inserted at {at}"
    return bytes(out), what


DAMAGES: tuple[Callable[[random.Random, bytes, Valid], tuple[bytes, str]], ...] = (
    bytes_damaged,
    bytes_damaged,
    member_edited,
    member_edited,
    record_edited,
)


def make_case(number: int, valid: Valid, path: Path) -> list[str]:
    """Case ``number``: the valid snapshot damaged, written at ``path``; what was done. Case 0
    is the snapshot as taken."""
    if number == 0:
        path.write_bytes(valid.data)
        return ["none: the snapshot as taken"]
    rng = random.Random(f"{SEED}-{number}")
    data, done = valid.data, []
    if rng.random() < 0.45:
        data, what = edited_payload(rng, valid)
        done.append(what)
    for _ in range(rng.choice([0, 1, 1, 2] if done else [1, 1, 1, 2])):
        data, what = rng.choice(DAMAGES)(rng, data, valid)
        done.append(what)
    path.write_bytes(data)
    if rng.random() < 0.03:  # sparse: a size past the limit costs no disk
        os.truncate(path, valid.limit + rng.choice([1, 1 << 30]))
        done.append("grown past the limit")
    return done


# --------------------------------------------------------------------------- what a relaunch does


def _conforms(current: Any, saved: Any, where: str) -> None:
    """What checked_snapshot promises of a snapshot it takes, checked again here: the keys and
    lengths of this launch's state, a plain CPU tensor of the same shape and dtype for each
    tensor, a plain value of the same kind for each plain value."""
    if isinstance(current, torch.Tensor):
        assert isinstance(saved, torch.Tensor) and not saved.is_sparse and saved.layout == torch.strided, where
        assert saved.device.type == "cpu" and saved.shape == current.shape and saved.dtype == current.dtype, where
        current.detach().clone().copy_(saved)  # what restore does: every element read
    elif isinstance(current, dict):
        assert isinstance(saved, dict) and set(saved) == set(current), where
        for key in current:
            _conforms(current[key], saved[key], f"{where}.{key}")
    elif isinstance(current, list | tuple):
        assert isinstance(saved, list | tuple) and len(saved) == len(current), where
        for i, (c, s) in enumerate(zip(current, saved)):
            _conforms(c, s, f"{where}[{i}]")
    elif current is None:
        assert saved is None or type(saved) in (bool, int, float, str), where
    elif type(current) in (bool, str):
        assert type(saved) is type(current), where
    elif type(current) in (int, float):
        assert type(saved) in (int, float), where
    else:
        assert type(saved) is type(current) and saved == current, where


def read_and_check(path: Path, valid: Valid) -> str:
    """One rank's snapshot file as a relaunch reads it; when taken, restored as restore would
    (its tensors copied, its RNG streams set: this is a forked child)."""
    try:
        data = read_snapshot(path, valid.limit)
        checked = checked_snapshot(
            data, step=STEP, rank=0, world_size=1, model_sd=valid.model_sd, optim_sd=valid.optim_sd
        )
    except UnusableSnapshot as exc:
        message = str(exc)
        assert message and message == visible(message), f"not one line: {message!r}"
        return f"refused: {message}"
    _conforms(valid.model_sd, checked.model, "model")
    _conforms(valid.optim_sd, checked.optim, "optim")
    set_rng_state(checked.rng)
    state = checked.trainer_state
    assert isinstance(state, dict) and state["step"] == STEP and state.get("world_size", 1) == 1, state
    json.dumps(state)
    return "taken"


def verdict(outcome: Outcome) -> str | None:
    """Why ``outcome`` is wrong (None when the snapshot was taken as promised or refused in one line)."""
    if outcome.returned:
        return None
    if outcome.hung:
        return "hung"
    if outcome.signal:
        return f"killed by signal {outcome.signal}"
    return f"{outcome.error_type}: {outcome.error}\n{outcome.traceback}"


def test_every_damaged_snapshot_is_taken_as_checked_or_refused_in_one_line(valid, tmp_path):
    started = time.monotonic()
    failures, counts = [], {"taken": 0, "refused": 0}
    number, path = 0, tmp_path / "step-00000004.rank00000.pt"  # each case written in the same place
    while number < CASES and time.monotonic() - started < SECONDS:
        done = make_case(number, valid, path)
        outcome = bounded(lambda: read_and_check(path, valid), seconds=CASE_SECONDS, extra_bytes=512 << 20)
        wrong = verdict(outcome)
        if valid.marker.exists():
            wrong = f"planted code ran; {wrong or outcome.value}"
            valid.marker.unlink()
        if wrong:
            failures.append(f"case {number} ({'; '.join(done)}): {wrong}")
        else:
            counts["taken" if outcome.value == repr("taken") else "refused"] += 1
        number += 1
    assert not failures, f"{len(failures)} of {number} cases (seed {SEED}):\n" + "\n".join(failures[:10])
    # Case 0, the snapshot as taken, is taken; the fuzz reaches both ends.
    assert counts["taken"] and counts["refused"], counts
    print(f"{number} cases in {time.monotonic() - started:.1f} s: {counts}")


def _one_member(valid: Valid, name: str, content: Callable[[bytes], bytes]) -> bytes:
    """The valid snapshot with its member ``name`` (data.pkl, byteorder) rewritten."""
    return _zipped([(n, content(c) if n.endswith(name) else c) for n, c in _members(valid.data, valid)])


def _first_entry_edited(valid: Valid, offset: int, value: int) -> bytes:
    """The valid snapshot with a 32-bit field of its first central directory entry set to ``value``."""
    out = bytearray(valid.data)
    struct.pack_into("<I", out, valid.directory + offset, value)
    return bytes(out)


def _step_a_tensor(valid: Valid) -> bytes:
    buffer = io.BytesIO()
    torch.save({**valid.payload, "step": torch.zeros(3)}, buffer)
    return buffer.getvalue()


# What the fuzz found escaping the reader as another exception (torch.load's parts, one of the
# checks) before each was made an UnusableSnapshot line, made again without the fuzz's dice.
FOUND = {
    "data.pkl empty (EOFError)": lambda v: _one_member(v, "data.pkl", lambda c: b""),
    "data.pkl cut short (EOFError)": lambda v: _one_member(v, "data.pkl", lambda c: c[: len(c) // 2]),
    "data.pkl a memo put on an empty stack (IndexError)": lambda v: _one_member(
        v, "data.pkl", lambda c: b"\x80\x02q\x00."
    ),
    "the byte order cut short (ValueError)": lambda v: _one_member(v, "byteorder", lambda c: c[:-1]),
    "a local header past the end (miniz's RuntimeError)": lambda v: _first_entry_edited(v, 42, 0xFFFFFFFE),
    "a record's name not UTF-8 (UnicodeDecodeError)": lambda v: v.data.replace(
        b"archive/byteorder", b"archive/byteord\xc1r"
    ),
    "a tensor where the step is (RuntimeError: a tensor's truth)": _step_a_tensor,
}


@pytest.mark.parametrize("damage", sorted(FOUND))
def test_what_torch_load_raised_is_one_refusal(valid, tmp_path, damage):
    path = tmp_path / "step-00000004.rank00000.pt"
    path.write_bytes(FOUND[damage](valid))
    outcome = bounded(lambda: read_and_check(path, valid), seconds=CASE_SECONDS, extra_bytes=512 << 20)
    assert verdict(outcome) is None and ast.literal_eval(outcome.value).startswith("refused: "), outcome
