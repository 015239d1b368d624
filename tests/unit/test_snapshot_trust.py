"""Memory snapshots as untrusted input (issue 45, trainer.checkpoints.snapshots and
snapshot_peers): nothing in a snapshot file, or in what the mirror between nodes receives,
makes a relaunch crash, restore a state the trainer never wrote, or allocate what a sender
only claims; and a snapshot directory someone else made is reported by ``jobgen status``.

- Restore (a real :class:`Snapshots` in a world of one on gloo): a snapshot that asks for a
  global, is no snapshot's shape, holds a tensor of another dtype, RNG streams a generator
  refuses, a trainer state that is no JSON object (or a scheduler state that would replace the
  scheduler's own attributes), or a link where the file should be, each makes the relaunch
  resume from disk (None) with the model, the optimizer and the RNG streams untouched, where the
  relaunch used to crash (UnpicklingError, TypeError) or restore the model before it failed.
- The mirror (:class:`SnapshotPeers` over a stand-in for torch.distributed that plays the
  other rank): a payload whose HMAC is not the job's key's is refused, and an announced size
  of 10**11 bytes is refused before anything is allocated (under an address-space limit,
  tests/bounded.py), where the mirror used to keep the first and allocate the second.
- The launch's key: a file of this user's alone, read back only from such a file.
- ``jobgen status RUN`` says when snapshots were off because another user made
  ``jobgen-<uid>`` first, naming that user, where only the rank's log said so.
Two ranks on two "nodes" through gloo: tests/distributed/test_snapshot_mirror_auth.py.
"""

from __future__ import annotations

import ast
import io
import os
import pwd
import random
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from bounded import bounded
from small_checkpoints import trainer_state

pytestmark = pytest.mark.torch

KEY = bytes(range(32))
STEP = 4


# ---------------------------------------------------------------- restore, in a world of one


@pytest.fixture
def world_of_one(monkeypatch):
    """A gloo process group of this process alone (a store in memory), destroyed after."""
    import torch
    import torch.distributed as dist

    from trainer.distributed import DistEnv

    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture
def taken(world_of_one, tmp_path):
    """A snapshot of step STEP taken by a real Snapshots, of a model and its Adam state after
    a step, with the trainer's state; the model and optimizer the relaunch restores into."""
    import torch

    from trainer.checkpoints.snapshots import Snapshots

    (tmp_path / "shm").mkdir()
    attempt = tmp_path / "shm" / f"jobgen-{os.getuid()}" / "run" / "7.0"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.25)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    snapshots = Snapshots(attempt, world_of_one, every_steps=STEP)
    state = trainer_state(STEP)
    snapshots.take(STEP, model, optimizer, state)
    snapshots.close()
    return SimpleNamespace(snapshots=snapshots, model=model, optimizer=optimizer, state=state)


def _what_restore_changes(t) -> dict:
    """Copies of everything a restore may set: weights, Adam's moments and step, the RNGs."""
    import numpy as np
    import torch

    return {
        "model": {k: v.clone() for k, v in t.model.state_dict().items()},
        "optim": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in t.optimizer.state_dict()["state"].items()
        },
        "lr": [g["lr"] for g in t.optimizer.param_groups],
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(legacy=True)[1].copy(),
    }


def _same(a: dict, b: dict) -> bool:
    import numpy as np
    import torch

    def equal(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, np.ndarray):
            return bool(np.array_equal(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        return x == y

    return equal(a, b)


def _moved_on(t) -> None:
    """What the relaunch did before it restores: other weights, other RNG streams."""
    import numpy as np
    import torch

    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(1.0)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)


class _Planted:
    """Pickles as a call of os.system: what a planted snapshot would run if it were unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _damaged(payload: dict, damage: str, marker: Path):
    import torch

    optim = payload["optim"]
    if damage == "a planted global":
        return {**payload, "model": _Planted(marker)}
    if damage == "no snapshot's shape: a list":
        return [1, 2, 3]
    if damage == "a weight of another shape":
        return {**payload, "model": {**payload["model"], "0.weight": torch.zeros(8, 5)}}
    if damage == "a weight of another dtype":
        return {**payload, "model": {k: v.double() for k, v in payload["model"].items()}}
    if damage == "an Adam moment of another shape (the model's weights are right)":
        state = {k: {**v, "exp_avg": torch.zeros(3)} for k, v in optim["state"].items()}
        return {**payload, "optim": {**optim, "state": state}}
    if damage == "an lr that is text":
        return {**payload, "optim": {**optim, "param_groups": [{**g, "lr": "fast"} for g in optim["param_groups"]]}}
    if damage == "rng: a python state of the wrong length":
        rng = payload["rng"]
        return {**payload, "rng": {**rng, "python": {**rng["python"], "state": torch.zeros(3, dtype=torch.int64)}}}
    if damage == "rng: python words beyond 32 bits":
        rng = payload["rng"]
        state = torch.full((625,), 2**40, dtype=torch.int64)
        return {**payload, "rng": {**rng, "python": {**rng["python"], "state": state}}}
    if damage == "trainer_state: not JSON":
        return {**payload, "trainer_state": "[1"}
    if damage == "trainer_state: a scheduler that sets its optimizer":
        import json

        state = json.loads(payload["trainer_state"])
        state["scheduler"] = {**state["scheduler"], "optimizer": 5}
        return {**payload, "trainer_state": json.dumps(state)}
    if damage == "trainer_state: another step":
        return {**payload, "trainer_state": payload["trainer_state"].replace(f'"step": {STEP}', '"step": 99')}
    raise AssertionError(damage)


DAMAGES = [
    "a planted global",
    "no snapshot's shape: a list",
    "a weight of another shape",
    "a weight of another dtype",
    "an Adam moment of another shape (the model's weights are right)",
    "an lr that is text",
    "rng: a python state of the wrong length",
    "rng: python words beyond 32 bits",
    "trainer_state: not JSON",
    "trainer_state: a scheduler that sets its optimizer",
    "trainer_state: another step",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_snapshot_sends_the_relaunch_to_disk_with_nothing_restored(taken, damage, tmp_path):
    import torch

    file = taken.snapshots.file(0, STEP)
    payload = torch.load(file, weights_only=True)
    marker = tmp_path / "planted-code-ran"
    buffer = io.BytesIO()
    torch.save(_damaged(payload, damage, marker), buffer)
    file.write_bytes(buffer.getvalue())

    _moved_on(taken)
    before = _what_restore_changes(taken)
    assert taken.snapshots.newest_common(None) == STEP
    assert taken.snapshots.restore(STEP, taken.model, taken.optimizer) is None  # resume from disk
    assert _same(_what_restore_changes(taken), before)  # not a weight, moment, lr or RNG stream changed
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_an_intact_snapshot_restores_everything(taken):
    import torch

    saved = torch.load(taken.snapshots.file(0, STEP), weights_only=True)
    _moved_on(taken)
    assert taken.snapshots.newest_common(None) == STEP
    assert taken.snapshots.restore(STEP, taken.model, taken.optimizer) == taken.state
    assert all(torch.equal(v, saved["model"][k]) for k, v in taken.model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["a link to a snapshot elsewhere", "a file larger than the state it holds"])
def test_a_snapshot_file_is_read_as_a_regular_file_of_bounded_size(taken, where, tmp_path):
    file = taken.snapshots.file(0, STEP)
    if where.startswith("a link"):
        elsewhere = tmp_path / "elsewhere.pt"
        elsewhere.write_bytes(file.read_bytes())  # a valid snapshot, but not in the private directory
        file.unlink()
        file.symlink_to(elsewhere)
    else:
        with file.open("ab") as fh:
            fh.truncate(1 << 30)  # sparse: 1 GiB claimed, more than 4x this state plus the margin
    _moved_on(taken)
    before = _what_restore_changes(taken)
    assert taken.snapshots.newest_common(None) == STEP
    assert taken.snapshots.restore(STEP, taken.model, taken.optimizer) is None
    assert _same(_what_restore_changes(taken), before)


# ---------------------------------------------------------------- the mirror's moves


class OtherRank:
    """Stands in for torch.distributed with rank 1 at the other end of every move: what rank 0
    posts to receive is filled from ``header`` (int64 words), ``verdict`` (whether rank 1 takes
    rank 0's payload) and ``payload``; what rank 0 sends is kept in ``sent``."""

    def __init__(self, header: list[int], payload: bytes = b"", verdict: int = 1):
        self.header, self.payload, self.verdict = header, payload, verdict
        self.sent: list[tuple[str, int, list[int]]] = []

    def isend(self, tensor, dst, group=None):
        self.sent.append((str(tensor.dtype), tensor.numel(), tensor.tolist() if tensor.numel() <= 8 else []))
        return SimpleNamespace(wait=lambda: None)

    def irecv(self, tensor, src, group=None):
        import torch

        if tensor.dtype == torch.uint8:
            assert tensor.numel() == len(self.payload)
            tensor.copy_(torch.frombuffer(bytearray(self.payload), dtype=torch.uint8))
        elif tensor.numel() == 1:
            tensor.fill_(self.verdict)
        else:
            words = (self.header + [0] * tensor.numel())[: tensor.numel()]
            tensor.copy_(torch.tensor(words, dtype=torch.int64))
        return SimpleNamespace(wait=lambda: None)


def _rank0_peers():
    import torch

    from trainer.checkpoints.snapshot_peers import SnapshotPeers
    from trainer.distributed import DistEnv

    env = DistEnv(0, 2, 0, torch.device("cpu"), "gloo")
    return SnapshotPeers(env, None, [1, 0], key=KEY)  # two nodes: each keeps the other's copy


def _tag_words(key: bytes, payload: bytes, step: int = STEP) -> list[int]:
    import torch

    from trainer.checkpoints.snapshot_peers import mirror_tag

    return torch.frombuffer(bytearray(mirror_tag(key, step, 1, 0, payload)), dtype=torch.int64).tolist()


def _a_snapshot() -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.ones(4)}}, buffer)
    return buffer.getvalue()


def _exchange(peers, other: OtherRank) -> tuple:
    """Rank 0's exchange of step STEP with ``other`` playing rank 1: what came back (or was
    raised), and what rank 0 sent (plain values: the child of bounded() returns their repr)."""
    try:
        kept = peers.exchange(b"rank 0's own snapshot", STEP)
        result = ("kept", [(s, len(b)) for s, b in kept])
    except Exception as exc:  # noqa: BLE001 - the refusal is the outcome
        result = (type(exc).__name__, str(exc))
    return result, other.sent


@pytest.mark.timeout(60)
def test_an_announced_size_beyond_what_the_receiver_expects_is_refused_before_it_allocates(monkeypatch):
    from trainer.checkpoints import snapshot_peers

    peers = _rank0_peers()
    other = OtherRank(header=[10**11, STEP, *([0] * 4)])  # 100 GB claimed
    monkeypatch.setattr(snapshot_peers, "dist", other)
    outcome = bounded(lambda: _exchange(peers, other), seconds=20, extra_bytes=256 << 20)
    assert outcome.returned, outcome  # no allocation failed under the address-space limit
    (error, message), sent = ast.literal_eval(outcome.value)
    assert error == "SnapshotRefused" and "announced 100000000000 bytes" in message, message
    verdicts = [words for dtype, n, words in sent if dtype == "torch.int64" and n == 1]
    assert verdicts == [[0]]  # rank 1 was told: its payload is never sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tag", ["another key's", "no tag at all"])
def test_a_payload_whose_hmac_is_not_the_jobs_is_refused(monkeypatch, tag):
    from trainer.checkpoints import snapshot_peers

    payload = _a_snapshot()
    words = _tag_words(bytes(32), payload) if tag == "another key's" else [0, 0, 0, 0]
    other = OtherRank(header=[len(payload), STEP, *words], payload=payload)
    monkeypatch.setattr(snapshot_peers, "dist", other)
    outcome = bounded(lambda: _exchange(_rank0_peers(), other), seconds=20)
    (error, message), _ = ast.literal_eval(outcome.value)
    assert error == "SnapshotRefused" and "from rank 1: its tag is not the job's" in message, message


@pytest.mark.timeout(60)
def test_the_jobs_own_payload_is_kept_and_rank_0s_carries_its_tag(monkeypatch):
    import torch

    from trainer.checkpoints import snapshot_peers

    payload = _a_snapshot()
    other = OtherRank(header=[len(payload), STEP, *_tag_words(KEY, payload)], payload=payload)
    monkeypatch.setattr(snapshot_peers, "dist", other)
    (result, sent) = _exchange(_rank0_peers(), other)
    assert result == ("kept", [(1, len(payload))])
    header = next(words for dtype, n, words in sent if dtype == "torch.int64" and n == 6)
    own = b"rank 0's own snapshot"
    tag = torch.tensor(header[2:], dtype=torch.int64).numpy().tobytes()
    assert header[:2] == [len(own), STEP] and tag == snapshot_peers.mirror_tag(KEY, STEP, 0, 1, own)
    # Of another step: refused before its payload comes.
    other = OtherRank(header=[len(payload), STEP - 1, *_tag_words(KEY, payload, STEP - 1)], payload=payload)
    monkeypatch.setattr(snapshot_peers, "dist", other)
    (error, message), _ = _exchange(_rank0_peers(), other)
    assert error == "SnapshotRefused" and "a snapshot of step 3, not 4" in message


@pytest.mark.timeout(60)
def test_the_launch_key_is_a_file_of_this_users_alone(tmp_path, monkeypatch):
    from jobgen.base.safe_read import DamagedFile
    from trainer.checkpoints import snapshot_peers as peers

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    directory = peers.key_directory()
    assert directory == tmp_path / "state" / "jobgen" / "snapshot-keys"
    name = peers._new_key_file(directory)
    path = directory / name.hex()
    assert oct(directory.stat().st_mode & 0o777) == "0o700" and oct(path.stat().st_mode & 0o777) == "0o600"
    key = peers._read_key_file(path)
    assert len(key) == 32 and key != peers._read_key_file(directory / peers._new_key_file(directory).hex())

    os.chmod(path, 0o640)  # readable by the group: not a key to trust
    with pytest.raises(peers.UnsafeKeyDirectory):
        peers._read_key_file(path)
    link = directory / ("0" * 32)
    link.symlink_to(path)
    with pytest.raises(DamagedFile, match="symbolic link"):
        peers._read_key_file(link)
    with pytest.raises(ValueError, match="no key file's name"):
        peers._read_key_file(directory / "../../elsewhere")


@pytest.mark.timeout(60)
def test_a_world_of_one_gets_a_key_and_leaves_no_file(world_of_one, tmp_path, monkeypatch):
    from trainer.checkpoints import snapshot_peers as peers

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    key = peers.launch_key(world_of_one, None)
    assert key is not None and len(key) == 32
    assert list(peers.key_directory().iterdir()) == []


# ---------------------------------------------------------------- jobgen status


def _someone_elses(path: Path, monkeypatch) -> int:
    """Make ``path`` (a directory) another user's: chown where this is root, else pretend this
    process is another user."""
    path.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        return 65534
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)
    return me


@pytest.mark.timeout(60)
def test_status_says_snapshots_are_off_and_whose_directory_took_their_place(tmp_path, monkeypatch):
    import torch

    from jobgen.report.status import run_status
    from jobgen.report.status_format import format_status
    from jobgen.slurm import client as slurm
    from run_dirs import training_run_at_step_25
    from trainer.checkpoints.snapshots import Snapshots
    from trainer.distributed import DistEnv

    run = training_run_at_step_25(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir()
    user_dir = shm / f"jobgen-{os.getuid()}"  # the name of this user's: another user made it first
    owner = _someone_elses(user_dir, monkeypatch)
    monkeypatch.setenv("JOBGEN_SNAPSHOT_DIR", str(user_dir / "stat" / "17.0"))
    monkeypatch.setenv("JOBGEN_RUN_DIR", str(run.path))
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    assert Snapshots.from_environment(env, every_steps=2) is None
    monkeypatch.undo()  # this process is itself again; the record stays

    monkeypatch.setattr(slurm, "queue", lambda job_ids=None: [])
    monkeypatch.setattr(slurm, "show_job", lambda job_id: [])
    monkeypatch.setattr(slurm, "config", lambda: {})
    status = run_status(run)
    lines = [w for w in status.warnings if w.startswith("memory snapshots are off")]
    name = pwd.getpwuid(owner).pw_name
    assert lines == [
        f"memory snapshots are off (job 17, node node1): {user_dir} belongs to {name} (uid {owner}), "
        "not to you: remove it, or set the site's paths.snapshot_dir elsewhere; a relaunch resumes from the "
        "last checkpoint instead"
    ], status.warnings
    assert f"WARNING  {lines[0]}" in format_status(status)

    # The next attempt that takes snapshots removes the record: status says nothing more.
    (shm / "mine").mkdir()
    monkeypatch.setenv("JOBGEN_SNAPSHOT_DIR", str(shm / "mine" / f"jobgen-{os.getuid()}" / "stat" / "18.0"))
    monkeypatch.setenv("JOBGEN_RUN_DIR", str(run.path))
    monkeypatch.setenv("SLURM_JOB_ID", "18")
    monkeypatch.setenv("SLURMD_NODENAME", socket.gethostname())
    assert Snapshots.from_environment(env, every_steps=2) is not None
    assert not [w for w in run_status(run).warnings if w.startswith("memory snapshots")]


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's takes root")
def test_every_level_of_the_snapshot_directory_must_be_this_users(tmp_path, monkeypatch):
    """Not only jobgen-<uid>: a run's directory in it that another user made (were jobgen-<uid>
    ever open to others) is refused the same way, and so is a link in its place."""
    import torch

    from trainer.checkpoints.snapshots import Snapshots
    from trainer.distributed import DistEnv

    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    monkeypatch.delenv("JOBGEN_RUN_DIR", raising=False)
    user_dir = tmp_path / "shm" / f"jobgen-{os.getuid()}"
    user_dir.mkdir(parents=True, mode=0o700)
    _someone_elses(user_dir / "run", monkeypatch)
    monkeypatch.setenv("JOBGEN_SNAPSHOT_DIR", str(user_dir / "run" / "7.0"))
    assert Snapshots.from_environment(env, every_steps=2) is None
    (user_dir / "other").mkdir()
    (user_dir / "linked").symlink_to(user_dir / "other")
    monkeypatch.setenv("JOBGEN_SNAPSHOT_DIR", str(user_dir / "linked" / "7.0"))
    assert Snapshots.from_environment(env, every_steps=2) is None
    assert not (user_dir / "other" / "7.0").exists()
    monkeypatch.setenv("JOBGEN_SNAPSHOT_DIR", str(user_dir / "mine" / "7.0"))
    assert Snapshots.from_environment(env, every_steps=2) is not None
