"""Who keeps a copy of whose memory snapshot, and the transfers between them
(train.snapshot_every_steps; trainer.checkpoints.snapshots takes and restores them).

Each rank mirrors its snapshot to one rank on the next node (the nodes in the order of their
first rank; the rank with the same place among its node's ranks), so that the snapshot of a
rank whose node is lost survives on another node, and a relaunch that put the rank on a spare
node (job.spare_nodes) gets it from there. The bytes go point to point over a gloo group of
their own, from the snapshot's writer thread, so they never interleave with training's
collectives; the group's timeout bounds a transfer whose partner died.

What a rank takes from the mirror is checked before it is used. Gloo, like the TCPStore the
ranks meet at, listens on every interface at a port anyone on the cluster can find and asks
no one who they are: another user could send a rank a "snapshot" of their own making, or
announce one of 10**12 bytes. So every move is three steps, each posted by both its ends:

1. the sender's header: the payload's size (-1: the sender could not read it), the step, and
   an HMAC-SHA256 tag over (step, sender rank, receiver rank, size, payload) under the
   launch's key (below);
2. the receiver's verdict: a size beyond what it expects (:func:`size_limit`: a few times its
   own snapshot, which is the same model's shard) or another step is refused here, before
   anything is allocated, and the sender, told so, never sends the payload;
3. the payload, whose tag the receiver checks (``hmac.compare_digest``) before it keeps a
   byte. A refusal on either end raises :class:`SnapshotRefused` once every posted transfer
   is done, so the two ends stay in step.

The key: 32 random bytes made for each launch of the program (what the mirror moves lives
in one launch: a relaunch connects again and gets a new key). It must reach every node of
the job without crossing the network the mirror uses, so it does not go over the process
group, which is that same unauthenticated channel. Rank 0 writes it to a new file (mode
0600, created exclusively, a random name) in a directory of the user's own,
``$XDG_STATE_HOME/jobgen/snapshot-keys`` (``~/.local/state/...``: under the home directory
a cluster's nodes share), which must be this user's, no link, and closed to everyone else
(0700). Only the file's random *name* goes over the group: another user who learns it can
neither read the file nor put one in its place, since every rank reads the key only from a
regular file of its own user's, 0600, exactly 32 bytes. Every rank reads it, the ranks agree
that all did (one collective), and rank 0 deletes it: it is on disk only while the mirror
connects (a launch killed meanwhile leaves it to the next one's rank 0, which deletes key
files older than a day), never in the run directory (shared with teammates), never in a log.
Where some rank cannot read it (a home directory its node does not share), the mirror is off
for the launch, said in the rank logs; each node still keeps its own ranks' snapshots.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import stat
import struct
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from jobgen.base.safe_read import open_regular
from trainer.distributed import DistEnv, all_gather_object

log = logging.getLogger("trainer.checkpoints.snapshot_peers")

KEY_BYTES = 32
_KEY_NAME = re.compile(r"^[0-9a-f]{32}$")
# A key file older than this was left by a launch killed while it connected.
STALE_KEY_SECONDS = 24 * 3600
# How long a rank looks for the key file rank 0 wrote (a shared file system's caches).
KEY_WAIT_SECONDS = 10.0
# What a receiver accepts: this many times its own snapshot's size, plus MARGIN_BYTES. The
# sender's shard is of the same model (FSDP shards are within a few rows of each other); a
# pipeline's stages differ more (the first holds the embeddings), hence more than 2x.
SIZE_FACTOR = 4
MARGIN_BYTES = 64 << 20
# The header of a move, int64 words: size, step, the tag (32 bytes).
_HEADER_WORDS = 2 + hashlib.sha256().digest_size // 8
_TAG_CONTEXT = b"jobgen snapshot mirror v1\0"


class SnapshotRefused(ValueError):
    """A snapshot the mirror did not take: its size, its step or its tag is not what the
    receiver expects, or the sender had none to send."""


class UnsafeKeyDirectory(RuntimeError):
    """The directory of the mirror's key is not this user's alone."""


def node_name() -> str:
    """This rank's node, as Slurm names it (the host's short name without Slurm)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def mirror_targets(nodes: list[str]) -> list[int]:
    """For each rank (``nodes[r]`` is its node), the rank that keeps a copy of its snapshot:
    the rank at its place (modulo their count) among the next node's ranks."""
    order = list(dict.fromkeys(nodes))
    by_node = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
    targets = []
    for rank, node in enumerate(nodes):
        following = by_node[order[(order.index(node) + 1) % len(order)]]
        targets.append(following[by_node[node].index(rank) % len(following)])
    return targets


def size_limit(local_bytes: int) -> int:
    """The most bytes a rank accepts from the mirror, its own snapshot being ``local_bytes``."""
    return SIZE_FACTOR * max(0, local_bytes) + MARGIN_BYTES


def mirror_tag(key: bytes, step: int, sender: int, receiver: int, payload: bytes | memoryview) -> bytes:
    """The HMAC-SHA256 of one move: ``payload``, rank ``sender``'s to ``receiver``, of ``step``."""
    mac = hmac.new(key, _TAG_CONTEXT + struct.pack(">qqqq", step, sender, receiver, len(payload)), hashlib.sha256)
    mac.update(payload)  # hashlib lets go of the GIL for large buffers: training goes on meanwhile
    return mac.digest()


class SnapshotPeers:
    """This rank's part of the mirror: where its snapshot goes, whose copies it keeps."""

    def __init__(self, env: DistEnv, group: dist.ProcessGroup | None, targets: list[int], key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"the mirror's key has {len(key)} bytes, not {KEY_BYTES}")
        self.env = env
        self.group = group
        self.target = targets[env.rank]
        self.sources = [rank for rank, target in enumerate(targets) if target == env.rank]
        self._key = key

    def __repr__(self) -> str:  # never the key
        return f"SnapshotPeers(rank={self.env.rank}, target={self.target}, sources={self.sources})"

    @classmethod
    def connect(cls, env: DistEnv, timeout_seconds: float) -> SnapshotPeers | None:
        """Collective, on every rank that takes snapshots: None where the ranks share one node
        (a copy there would share its fate), or where some rank could not read the launch's key."""
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
        nodes = [str(n) for n in all_gather_object(env, node_name())]
        if len(set(nodes)) < 2:
            return None
        key = launch_key(env, group)
        if key is None:
            return None
        return cls(env, group, mirror_targets(nodes), key)

    def exchange(self, data: bytes, step: int) -> list[tuple[int, bytes]]:
        """Send this rank's snapshot of ``step`` to its target; the snapshots of the ranks it
        keeps copies of, as (their rank, bytes), each at most :func:`size_limit` of ``data``'s
        size. Every rank calls it for the same step."""
        receiving = [(s, self.env.rank) for s in self.sources]
        return self.transfer(receiving, {self.target: data}, step, size_limit(len(data)))

    def transfer(
        self, receiving: list[tuple[int, int]], outgoing: dict[int, bytes | None], step: int, limit: int
    ) -> list[tuple[int, bytes]]:
        """Point-to-point moves of snapshots of ``step`` this rank takes part in: it sends
        ``outgoing[receiver]`` (None: it could not read it) to each receiver, and receives what
        each (sender, this rank) of ``receiving`` sends, at most ``limit`` bytes, returned as
        (sender, bytes). Every move is posted by both its ends, in the three steps of the
        module's docstring; any refusal, on either end, raises :class:`SnapshotRefused` once
        all are done."""
        me = self.env.rank
        senders = [s for s, r in receiving if r == me]
        headers = {s: torch.zeros(_HEADER_WORDS, dtype=torch.int64) for s in senders}
        self._wait(
            [dist.isend(self._header(step, r, data), dst=r, group=self.group) for r, data in outgoing.items()]
            + [dist.irecv(headers[s], src=s, group=self.group) for s in senders]
        )
        refused = {s: self._problem(headers[s], step, limit) for s in senders}
        verdicts = {r: torch.zeros(1, dtype=torch.int64) for r in outgoing}
        self._wait(
            [dist.isend(torch.tensor([int(refused[s] is None)]), dst=s, group=self.group) for s in senders]
            + [dist.irecv(verdicts[r], src=r, group=self.group) for r in outgoing]
        )
        # Only now, and only what this rank accepted, is allocated.
        sizes = {s: int(headers[s][0]) for s in senders if refused[s] is None}
        buffers = {s: torch.empty(size, dtype=torch.uint8) for s, size in sizes.items() if size}
        sending = {r: data for r, data in outgoing.items() if data and int(verdicts[r][0]) == 1}
        self._wait(
            [
                dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=r, group=self.group)
                for r, data in sending.items()
            ]
            + [dist.irecv(buffer, src=s, group=self.group) for s, buffer in buffers.items()]
        )
        kept = []
        for s in sizes:
            view = memoryview(buffers[s].numpy()) if s in buffers else memoryview(b"")
            told = headers[s][2:].numpy().tobytes()
            if hmac.compare_digest(mirror_tag(self._key, step, s, me, view), told):
                kept.append((s, view.tobytes()))
            else:
                refused[s] = "its tag is not the job's (not sent by this job's rank, or altered on the way)"
        problems = [f"from rank {s}: {why}" for s, why in refused.items() if why is not None]
        problems += [f"rank {r} refused ours" for r, data in outgoing.items() if data and r not in sending]
        if problems:
            raise SnapshotRefused(f"snapshot of step {step} not kept: {'; '.join(problems)}")
        return kept

    def _header(self, step: int, receiver: int, data: bytes | None) -> torch.Tensor:
        if data is None:
            return torch.tensor([-1, step] + [0] * (_HEADER_WORDS - 2), dtype=torch.int64)
        tag = mirror_tag(self._key, step, self.env.rank, receiver, data)
        return torch.cat(
            [torch.tensor([len(data), step], dtype=torch.int64), torch.frombuffer(bytearray(tag), dtype=torch.int64)]
        )

    @staticmethod
    def _problem(header: torch.Tensor, step: int, limit: int) -> str | None:
        """Why a move announced by ``header`` is refused before its payload comes, or None."""
        size, sent_step = int(header[0]), int(header[1])
        if size == -1:
            return "it had no snapshot to send (its file could not be read)"
        if sent_step != step:
            return f"a snapshot of step {sent_step}, not {step}"
        if not 0 <= size <= limit:
            return f"it announced {size} bytes, more than the {limit} this rank takes"
        return None

    @staticmethod
    def _wait(works: list) -> None:
        for work in works:
            work.wait()


# ---------------------------------------------------------------------- the launch's key


def key_directory() -> Path:
    """Where rank 0 leaves the launch's key for the other ranks: the user's state directory."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "jobgen" / "snapshot-keys"


def launch_key(env: DistEnv, group: dist.ProcessGroup | None) -> bytes | None:
    """The mirror's key for this launch, on every rank, or None on every rank when some rank
    could not read it (collective over ``group``: one broadcast of the file's name, one
    all-reduce of whether each rank read it, a barrier once rank 0 deleted the file)."""
    directory = key_directory()
    made, name, problem = False, bytes(16), None
    if env.rank == 0:
        try:
            name = _new_key_file(directory)
            made = True
        except (OSError, UnsafeKeyDirectory) as exc:
            problem = f"could not write the key: {type(exc).__name__}: {exc}"
    box = torch.tensor([*name, int(made)], dtype=torch.uint8)
    dist.broadcast(box, src=0, group=group)
    key = None
    if int(box[16]):
        try:
            key = _read_key_file(directory / bytes(box[:16].tolist()).hex())
        except (OSError, ValueError, UnsafeKeyDirectory) as exc:
            problem = f"could not read the key rank 0 wrote: {type(exc).__name__}: {exc}"
    everyone = torch.tensor([int(key is not None)], dtype=torch.int64)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
    if made:  # every rank has read it, or given up: no longer needed on disk
        (directory / name.hex()).unlink(missing_ok=True)
    dist.barrier(group=group)  # gone before any rank goes on
    if not int(everyone[0]):
        if problem:
            log.warning("rank %d: %s", env.rank, problem)
        if env.is_main:
            log.warning(
                "memory snapshots are not mirrored to other nodes in this launch: not every rank could read "
                "its key from %s (is it on a file system every node shares?); each node keeps its own ranks'",
                directory,
            )
        return None
    return key


def _private_key_directory(directory: Path) -> None:
    """``directory``, made if missing: this user's, a directory (no link), closed to others."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise UnsafeKeyDirectory(f"{directory} is not a directory of this user's")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700, follow_symlinks=False)


def _new_key_file(directory: Path) -> bytes:
    """A new key in a new file of ``directory``; its name's 16 random bytes."""
    _private_key_directory(directory)
    now = time.time()
    for old in directory.iterdir():
        try:
            if _KEY_NAME.match(old.name) and now - old.lstat().st_mtime > STALE_KEY_SECONDS:
                old.unlink()
        except OSError:
            pass
    name = secrets.token_bytes(16)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(directory / name.hex(), flags, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    return name


def _read_key_file(path: Path) -> bytes:
    """The key in ``path``: a regular file (no link) of this user's, 0600, of KEY_BYTES bytes."""
    if not _KEY_NAME.match(path.name):
        raise ValueError(f"{path.name!r} is no key file's name")
    deadline = time.monotonic() + KEY_WAIT_SECONDS
    while True:
        try:
            fd = open_regular(path)
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise UnsafeKeyDirectory(f"{path} is not a file of this user's alone")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} holds {len(key)} bytes, not a key of {KEY_BYTES}")
    return key
