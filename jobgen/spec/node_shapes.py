"""Unequal nodes placed from the site's description of its nodes (``slurm.node_shapes``, which
``jobgen site init`` reads from Slurm), so that ``job.procs_per_node = [3, 1]`` on a GPU site
needs no ``job.nodelist``.

One request of a GPU per process (``--gpus=4``) is split by Slurm over the nodes it picks, its
own way, unless the nodes are named and each has exactly its entry's GPUs. A heterogeneous job
(one component per shape) would let Slurm pick them itself, but Slurm refuses it as a job array
(22.05: ``sbatch --array`` of a ``hetjob`` script, "Invalid job array specification"), and the
array is what carries a run past each time limit. So jobgen names the nodes: for each entry, in
order, the next node (in Slurm's order of names) whose shape has exactly that many GPUs. The
choice is written into ``job.nodelist`` of the resolved spec (spec.json), and preflight checks it
against the live cluster as it checks a nodelist the user wrote.
"""

from __future__ import annotations

import re

from jobgen.spec.tables.site import NodeShape

# One bracket group, as Slurm writes a range of names: gpu[01-03,07].
_RANGE = re.compile(r"^([^\[\]]*)\[([0-9,\-]+)\]([^\[\]]*)$")


def expand_hostlist(expression: str) -> list[str] | None:
    """The node names of ``node1,node2`` or ``gpu[01-03,07]`` (zero padding kept); None for a
    form this does not read (several bracket groups), which only Slurm's own ``scontrol show
    hostnames`` can expand."""
    names: list[str] = []
    for part in re.split(r",(?![^\[]*\])", expression):
        if "[" not in part:
            names.append(part)
            continue
        match = _RANGE.match(part)
        if match is None:
            return None
        head, ranges, tail = match.groups()
        for item in ranges.split(","):
            first, _, last = item.partition("-")
            if not first.isdigit() or (last and not last.isdigit()):
                return None
            for number in range(int(first), int(last or first) + 1):
                names.append(f"{head}{str(number).zfill(len(first))}{tail}")
    return [name for name in names if name]


def _natural(name: str) -> list[object]:
    """Slurm lists nodes as its configuration does, which is nearly always node2 before node10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def place(counts: tuple[int, ...], shapes: list[NodeShape]) -> list[str] | None:
    """A node for each entry of ``counts`` with exactly its GPUs, in Slurm's order of names (entry
    N runs on node N of the allocation); None when the shapes cannot give them."""
    gpus_of: dict[str, int] = {}
    for shape in shapes:
        names = expand_hostlist(shape.nodes)
        if names is None:
            return None
        gpus_of.update(dict.fromkeys(names, shape.gpus))
    ordered = sorted(gpus_of, key=_natural)
    chosen: list[str] = []
    start = 0
    for count in counts:
        index = next((i for i in range(start, len(ordered)) if gpus_of[ordered[i]] == count), None)
        if index is None:
            return None
        chosen.append(ordered[index])
        start = index + 1
    return chosen
