"""Who keeps a copy of whose memory snapshot, and the transfers between them
(train.snapshot_every_steps; trainer.checkpoints.snapshots takes and restores them).

Each rank mirrors its snapshot to one rank on the next node (the nodes in the order of their
first rank; the rank with the same place among its node's ranks), so that the snapshot of a
rank whose node is lost survives on another node, and a relaunch that put the rank on a spare
node (job.spare_nodes) gets it from there. The bytes go point to point over a gloo group of
their own, from the snapshot's writer thread, so they never interleave with training's
collectives; the group's timeout bounds a transfer whose partner died.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.distributed import DistEnv, all_gather_object


def node_name() -> str:
    """This rank's node, as Slurm names it (the host's short name without Slurm)."""
    import os

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


class SnapshotPeers:
    """This rank's part of the mirror: where its snapshot goes, whose copies it keeps."""

    def __init__(self, env: DistEnv, group: dist.ProcessGroup, targets: list[int]):
        self.env = env
        self.group = group
        self.target = targets[env.rank]
        self.sources = [rank for rank, target in enumerate(targets) if target == env.rank]

    @classmethod
    def connect(cls, env: DistEnv, timeout_seconds: float) -> SnapshotPeers | None:
        """Collective, on every rank that takes snapshots: None where the ranks share one node
        (a copy there would share its fate)."""
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
        nodes = [str(n) for n in all_gather_object(env, node_name())]
        if len(set(nodes)) < 2:
            return None
        return cls(env, group, mirror_targets(nodes))

    def exchange(self, data: bytes, step: int) -> list[tuple[int, bytes]]:
        """Send this rank's snapshot of ``step`` to its target; the snapshots of the ranks it
        keeps copies of, as (their rank, bytes). Every rank calls it for the same step."""
        return self.transfer([(s, self.env.rank) for s in self.sources], {self.target: data}, step)

    def transfer(
        self, receiving: list[tuple[int, int]], outgoing: dict[int, bytes], step: int
    ) -> list[tuple[int, bytes]]:
        """Point-to-point moves of snapshots of ``step`` this rank takes part in: it sends
        ``outgoing[receiver]`` to each receiver, and receives what each (sender, this rank) of
        ``receiving`` sends, returned as (sender, bytes). Every move is posted by both its ends.
        Each move says its step first: one of another step (a partner that skipped a snapshot
        while it waited for the one before) is refused (ValueError), never kept as this one."""
        senders = [s for s, r in receiving if r == self.env.rank]
        sizes = {s: torch.zeros(2, dtype=torch.int64) for s in senders}
        lengths = {r: torch.tensor([len(b), step], dtype=torch.int64) for r, b in outgoing.items()}
        self._wait(
            [dist.isend(lengths[r], dst=r, group=self.group) for r in outgoing]
            + [dist.irecv(sizes[s], src=s, group=self.group) for s in senders]
        )
        buffers = {s: torch.empty(int(sizes[s][0]), dtype=torch.uint8) for s in senders}
        payloads = {r: torch.frombuffer(bytearray(b), dtype=torch.uint8) for r, b in outgoing.items() if b}
        self._wait(
            [dist.isend(payload, dst=r, group=self.group) for r, payload in payloads.items()]
            + [dist.irecv(buffers[s], src=s, group=self.group) for s in senders if buffers[s].numel()]
        )
        wrong = {s: int(sizes[s][1]) for s in senders if int(sizes[s][1]) != step}
        if wrong:
            raise ValueError(f"snapshots of other steps than {step} came from ranks {wrong}: not kept")
        return [(s, buffers[s].numpy().tobytes()) for s in senders]

    @staticmethod
    def _wait(works: list) -> None:
        for work in works:
            work.wait()
