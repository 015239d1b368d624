"""A site profile's text, written from what Slurm says of the cluster (:mod:`jobgen.sites.inventory`)
and what it cannot say (:class:`ProfileChoices`, the flags of ``jobgen site init``).

The text is TOML with comments that say where each value came from, so that a person can read
and change it. It is checked before it is returned: it must parse, and
:class:`jobgen.spec.tables.site.SiteProfile` must accept it, as ``jobgen validate`` will.
Names Slurm gives (partitions, nodes) are input to it: one that the spec's own field rules
refuse is a :class:`ProfileError` naming it, not a profile that fails later.
"""

from __future__ import annotations

import datetime as dt
import socket
import sys
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from jobgen.base.durations import format_slurm
from jobgen.base.visible import visible
from jobgen.sites.inventory import Inventory, Node, Partition, Shape
from jobgen.spec.fields import SlurmName
from jobgen.spec.tables.site import SiteName, SiteProfile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_RUNS_ROOT = "~/jobgen-runs"


class ProfileError(ValueError):
    """A profile that cannot be written: a name from Slurm or a flag the spec refuses, or a
    partition with nothing to describe. The message names the value and the rule."""


@dataclass(frozen=True)
class ProfileChoices:
    """What Slurm cannot say of a site, given by ``jobgen site init``'s flags."""

    partition: str | None = None  # None: the cluster's default partition, else its only one
    runs_root: str = DEFAULT_RUNS_ROOT
    ifname: str | None = None  # None: written commented out; `jobgen doctor --site NAME` finds it
    transport: Literal["socket", "ib"] = "socket"
    account: str | None = None
    qos: str | None = None
    reservation: str | None = None
    gres_name: str | None = None  # None: "gpu:<type>" when every node has one type, else "gpu"
    gpu_compute: bool = True  # False: the GPUs are scheduled but not computed on (the dev cluster's fake ones)


# ---------------------------------------------------------------- values


def toml_string(value: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped; everything else,
    non-ASCII included, as it is (json.dumps would write a character past U+FFFF as a surrogate
    pair, which TOML refuses)."""
    out = []
    for char in value:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def spec_value(kind: Any, value: str, what: str) -> str:
    """``value`` when the spec's field type ``kind`` (SlurmName, SiteName) accepts it, else a
    ProfileError saying what it is and the rule it breaks, in the spec's own words."""
    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError as exc:
        message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ProfileError(f"{what}: {message}") from None


def _memory(shape: Shape) -> str:
    return f"{shape.memory_mb}M"


def _names(nodes: tuple[str, ...]) -> str:
    return ",".join(nodes)


# ---------------------------------------------------------------- the tables


def _partition_line(inventory: Inventory, partition: Partition, chosen: Partition) -> str:
    limit = "UNLIMITED" if partition.max_time is None else format_slurm(partition.max_time)
    notes = [n for n, on in (("default", partition.default), ("hidden", partition.hidden)) if on]
    if partition.state.upper() != "UP":
        notes.append(f"state {partition.state}")
    if partition.name == chosen.name:
        notes.append("this profile's")
    count = len(inventory.nodes_of(partition.name))
    return f"#   {visible(partition.name):<16} MaxTime {limit:<12} {count} node(s)" + (
        f"  ({', '.join(visible(n) for n in notes)})" if notes else ""
    )


def _header(inventory: Inventory, name: str, chosen: Partition, written_on: str, host: str) -> list[str]:
    return [
        f"# Site profile '{name}', written by `jobgen site init {name}` on {written_on}",
        f"# from Slurm {visible(inventory.slurm_version)} on host {visible(host)}.",
        "#",
        "# The partitions of this cluster (MaxTime: the longest a job there may run):",
        *(_partition_line(inventory, p, chosen) for p in inventory.partitions),
        f"# This profile is for '{chosen.name}'. For another, run",
        f"#   jobgen site init {name} --partition PARTITION --force",
        "# (or set job.partition in a run.toml for one run).",
        "#",
        "# Slurm cannot say everything: check [network], [paths] and [python] below, then run",
        f"#   jobgen doctor --site {name}",
        "",
    ]


def _optional_keys(choices: ProfileChoices) -> list[str]:
    """account, qos and reservation: keys when given, else commented examples."""
    lines = []
    for key, value, example, flag in (
        ("account", choices.account, "my-account", "--account"),
        ("qos", choices.qos, "normal", "--qos"),
        ("reservation", choices.reservation, "my-reservation", "--reservation"),
    ):
        if value is not None:
            lines.append(f"{key} = {toml_string(value)}")
        else:
            lines.append(f"# {key} = {toml_string(example)}  # where the cluster wants one ({flag})")
    return lines


def _gpu_keys(nodes: tuple[Node, ...], shapes: tuple[Shape, ...], choices: ProfileChoices, where: str) -> list[str]:
    """gpus_per_node and gres_name, from the GPUs of the partition's nodes."""
    counts = {n.gpus for n in nodes}
    lines = []
    if len(counts) > 1:
        each = ", ".join(f"{s.gpus} ({_names(s.nodes)})" for s in shapes)
        lines += [
            f"# The nodes of {where} differ in GPUs: {each}. This is the most of any;",
            "# a run on nodes with fewer sets job.procs_per_node as a list, e.g. [3, 1] (see node_shapes below).",
        ]
    elif max(counts) == 0:
        lines.append(f"# The nodes of {where} have no GPUs (no gpu in their Gres): ranks compute on CPUs over gloo.")
    lines.append(f"gpus_per_node = {max(counts)}")
    types = {n.gpu_type for n in nodes}
    gres = choices.gres_name or (f"gpu:{types.pop()}" if len(types) == 1 and None not in types else "gpu")
    lines.append(f"gres_name = {toml_string(gres)}  # what --gres=<gres_name>:<n> asks for")
    if choices.gpu_compute:
        lines.append("# gpu_compute = false  # where the GPUs Slurm schedules are not computed on (the dev cluster's)")
    else:
        lines.append("gpu_compute = false  # the GPUs are scheduled, the ranks compute on the CPU (--no-gpu-compute)")
    return lines


def _slurm_table(inventory: Inventory, partition: Partition, choices: ProfileChoices) -> list[str]:
    nodes = inventory.nodes_of(partition.name)
    shapes = inventory.shapes(partition.name)
    where = f"'{partition.name}'"
    fewest = min(nodes, key=lambda n: n.usable_cpus)
    cpus_note = "" if fewest.usable_cpus == fewest.cpus else f" (of CPUTot {fewest.cpus}: Slurm keeps the rest)"
    by_memory: dict[str, list[str]] = {}
    for shape in shapes:
        by_memory.setdefault(_memory(shape), []).extend(shape.nodes)
    memories = ", ".join(f"{memory} ({_names(tuple(names))})" for memory, names in by_memory.items())
    return [
        "[slurm]",
        f"partition = {toml_string(partition.name)}",
        *_optional_keys(choices),
        *_gpu_keys(nodes, shapes, choices, where),
        f"# The one task per node asks for this many CPUs (--cpus-per-task): the fewest of any node of {where}"
        f"{cpus_note}.",
        f"cpus_per_node = {fewest.usable_cpus}",
        f"# All of each node's memory (--mem=0). Slurm's RealMemory: {memories}.",
        'mem = "0"',
        *_shapes_tables(shapes, where),
    ]


def _shapes_tables(shapes: tuple[Shape, ...], where: str) -> list[str]:
    lines = ["", f"# The kinds of machine in {where}, each with its nodes (GPUs, CPUs, RealMemory)."]
    for shape in shapes:
        lines += [
            "[[slurm.node_shapes]]",
            f"nodes = {toml_string(_names(shape.nodes))}",
            f"gpus = {shape.gpus}",
            f"cpus = {shape.cpus}",
            f"memory = {toml_string(_memory(shape))}",
            "",
        ]
    return lines[:-1]


def _network_table(name: str, choices: ProfileChoices) -> list[str]:
    if choices.ifname is not None:
        ifname = f"ifname = {toml_string(choices.ifname)}"
    else:
        ifname = f'# ifname = "eth0"  # the nodes\' interface to each other: `jobgen doctor --site {name}` finds it'
    return [
        "[network]",
        ifname,
        "# 'ib' for InfiniBand or RoCE (NCCL over the HCAs), 'socket' for Ethernet only.",
        f"transport = {toml_string(choices.transport)}",
        "# The rendezvous at the head node's address on ifname (without ifname: its hostname).",
        "resolve_head_ip = true",
    ]


def _other_tables(choices: ProfileChoices) -> list[str]:
    """[paths], [python] and [env]: what Slurm knows nothing of."""
    return [
        "[paths]",
        "# Where run directories go: a directory every node sees (a shared filesystem).",
        f"runs_root = {toml_string(choices.runs_root)}",
        "",
        "[python]",
        "# The environment that runs `jobgen submit` (a venv or conda environment), activated on every node.",
        'kind = "auto"',
        "# Or name one (`jobgen schema --markdown` lists the keys of each):",
        '# kind = "venv"       with venv = "/shared/envs/llm"',
        '# kind = "conda"      with conda_env = "llm" (a name or a prefix)',
        '# kind = "modules"    with modules = ["cuda/12.4"]',
        '# kind = "container"  with container_image = "registry.example.org#team/jobgen:0.1.0"',
        "",
        "[env]",
        "# Variables every job of this site gets, e.g. when the nodes cannot reach the Hugging Face hub:",
        '# HF_HUB_OFFLINE = "1"',
    ]


# ---------------------------------------------------------------- the profile


def profile_text(
    inventory: Inventory,
    name: str,
    choices: ProfileChoices,
    *,
    written_on: str | None = None,
    host: str | None = None,
) -> str:
    """The commented TOML of site profile ``name`` for the chosen partition of ``inventory``,
    checked by SiteProfile. ``written_on`` and ``host`` (for the header) default to today and
    this machine."""
    spec_value(SiteName, name, "site name")
    partition = inventory.choose_partition(choices.partition)
    spec_value(SlurmName, partition.name, "partition name from Slurm")
    nodes = inventory.nodes_of(partition.name)
    if not nodes:
        raise ProfileError(
            f"partition '{partition.name}' has no nodes to describe; choose another with --partition: "
            f"{inventory.partition_names()}"
        )
    for node in nodes:
        spec_value(SlurmName, node.name, f"node name from Slurm (partition '{partition.name}')")
    written_on = written_on or dt.date.today().isoformat()
    lines = [
        *_header(inventory, name, partition, written_on, host or socket.gethostname()),
        f"name = {toml_string(name)}",
        f"description = {toml_string(_description(inventory, partition))}",
        "",
        *_slurm_table(inventory, partition, choices),
        "",
        *_network_table(name, choices),
        "",
        *_other_tables(choices),
    ]
    text = "\n".join(lines) + "\n"
    check_profile(text)
    return text


def _description(inventory: Inventory, partition: Partition) -> str:
    nodes = inventory.nodes_of(partition.name)
    gpus = sorted({n.gpus for n in nodes})
    per_node = "no GPUs" if gpus == [0] else f"{'/'.join(str(g) for g in gpus)} GPU(s) per node"
    return f"partition {partition.name}: {len(nodes)} node(s), {per_node} (from Slurm {inventory.slurm_version})"


def check_profile(text: str) -> None:
    """ProfileError unless ``text`` parses as TOML and SiteProfile accepts it; the message lists
    every problem by key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"the profile written is not TOML ({exc}); this is a bug in jobgen") from None
    try:
        SiteProfile.model_validate(data)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in error['loc'])}: {str(error['msg']).removeprefix('Value error, ')}"
            for error in exc.errors()
        ]
        raise ProfileError("the site profile would not be valid:\n  " + "\n  ".join(problems)) from None
