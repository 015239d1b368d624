"""A node lost while a launch with spares runs (job.spare_nodes), found by the supervisor in
seconds rather than by Slurm after SlurmdTimeout (300 s by default), so the relaunch on the
spares starts at once. The trigger is the launch's own end on the nodes that live: a
rank that ended (its end record, :func:`jobgen.runs.quarantine.record_rank_failure`: a peer's
connection closed under it, or the collective timed out) while the launch goes on past a short
grace, because srun waits for a node that no longer answers. The confirming check asks each of
the launch's other nodes' slurmd for a connection, a few seconds apart; nothing is asked while
the ranks are training, so a healthy job sends slurmd nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jobgen.job.decisions import (
    NODE_CHECK_SECONDS,
    NODE_MISSES_TO_LOSE,
    hang_waits_for_node_watch,
    lost_nodes,
    node_misses,
    suspect_lost_node,
)


@dataclass
class NodeWatch:
    """One launch's nodes (the batch host's own left out: its loss ends the job whatever is done)."""

    nodes: list[str]
    ranks_ended: Callable[[], bool]  # has a rank of this launch left its end record?
    addresses: Callable[[list[str]], dict[str, tuple[str, int]]]  # where each node's slurmd listens
    answers: Callable[[tuple[str, int]], bool]  # does it accept a connection?
    every: float = NODE_CHECK_SECONDS
    next_look: float = field(default_factory=lambda: time.monotonic() + NODE_CHECK_SECONDS)
    first_end: float | None = None
    misses: dict[str, int] = field(default_factory=dict)
    known: dict[str, tuple[str, int]] | None = None

    def judging(self, now: float) -> bool:
        """A rank ended and the nodes are still being checked: the hang watch waits."""
        return hang_waits_for_node_watch(None if self.first_end is None else now - self.first_end)

    def look(self, now: float) -> dict[str, str]:
        """The nodes found lost at this look, with why (empty: none, or not time to look)."""
        if not self.nodes or now < self.next_look:
            return {}
        self.next_look = now + self.every
        if self.first_end is None:
            if self.ranks_ended():
                self.first_end = now
            return {}
        if not suspect_lost_node(now - self.first_end):
            return {}
        if self.known is None:
            self.known = self.addresses(self.nodes)
        self.misses = node_misses(self.misses, {node: self.answers(at) for node, at in self.known.items()})
        return {
            node: f"lost: its slurmd at {self.known[node][0]}:{self.known[node][1]} did not answer "
            f"{NODE_MISSES_TO_LOSE} checks {self.every:.0f} s apart, after the launch's other ranks had ended"
            for node in lost_nodes(self.misses)
        }
