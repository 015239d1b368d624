"""The programs a run can be (``job.program``): one entry per kind, carrying what the spec
checks, the batch script, preflight and status need of it. Every room reads a program's
behaviour from its entry here, never from its name (tests/unit/test_dispatch_tables.py).

- ``train``: the bundled trainer (``python -m trainer``) on [model], [data] and [train]; it
  saves, resumes and stops on request, and the memory plan, the world-size and batch checks,
  the resume check and ``max_steps`` apply to it alone.
- ``doctor``: the node health check (``python -m trainer.doctor``): one job, no model or data,
  a verdict per node.
- ``command``: your own program from [command], started on every rank by jobgen's launcher
  (``jobgen.runtime.launch``) with a plan written for each attempt on the head node
  (jobgen.launch.command_plan: the checkpoint it resumes from, the placeholders of its
  arguments and [env] expanded); it keeps its own checkpoints.

A new kind is a new entry (and its name in :data:`ProgramName`); what differs about it is a
field here that the rooms already read, or a new field they learn to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ProgramName = Literal["train", "doctor", "command"]


@dataclass(frozen=True)
class Program:
    """What one ``job.program`` is, for every room that treats programs differently."""

    name: str
    module: str  # what torchrun starts on every node: python -m <module>
    needs: tuple[str, ...]  # tables of run.toml it cannot run without
    needs_words: str | None  # what the spec's message says it needs, when not the missing tables
    owns: tuple[str, ...]  # tables of run.toml that only this program reads
    trains: bool  # the bundled trainer: [model], [data] and [train] apply
    resumable: bool  # a chained array: switches, failed and done markers, stop requests, quarantine
    planned: bool  # each attempt planned on the head node; [env] and [command] hold placeholders
    own_checkpoints: bool  # saves by its own rules (a Hugging Face Trainer's checkpoint-N/ count)
    checks_nodes: bool  # ends with a health verdict per node, which status shows
    # job.in_job_restarts: the batch script may start it again inside the task after a failure,
    # and it resumes from its newest state, telling its launches apart (JOBGEN_LAUNCH).
    relaunches: bool
    # What the job's Python environment must hold for it: (the jobgen extra that installs it,
    # the top-level module), checked by validate and submit (jobgen.launch.environment).
    imports: tuple[tuple[str, str], ...] = ()

    def missing(self, present: dict[str, bool]) -> str | None:
        """What the spec's message says this program lacks, given which tables are present;
        None when it has them all."""
        absent = [table for table in self.needs if not present[table]]
        if not absent:
            return None
        return self.needs_words or f"the table(s) {', '.join('[' + table + ']' for table in absent)}"


PROGRAMS: dict[str, Program] = {
    "train": Program(
        "train",
        module="trainer",
        needs=("model", "data"),
        needs_words=None,
        owns=("eval",),
        trains=True,
        resumable=True,
        planned=False,
        own_checkpoints=False,
        checks_nodes=False,
        relaunches=True,
        imports=tuple(("train", m) for m in ("torch", "transformers", "datasets", "tokenizers", "safetensors")),
    ),
    "doctor": Program(
        "doctor",
        module="trainer.doctor",
        needs=(),
        needs_words=None,
        owns=(),
        trains=False,
        resumable=False,
        planned=False,
        own_checkpoints=False,
        checks_nodes=True,
        relaunches=False,
        imports=(("train", "torch"),),
    ),
    "command": Program(
        "command",
        module="jobgen.runtime.launch",
        needs=("command",),
        needs_words="a [command] table with module or script",
        owns=("command",),
        trains=False,
        resumable=True,
        planned=True,
        own_checkpoints=True,
        checks_nodes=False,
        # The batch script writes the plan again before each relaunch: the newest checkpoint.
        relaunches=True,
        imports=(("train", "torch"),),  # torchrun, and torch.distributed for jobgen.runtime
    ),
}
assert tuple(PROGRAMS) == ProgramName.__args__, "one entry per job.program, in the order of ProgramName"


def program(name: str) -> Program:
    return PROGRAMS[name]


def owned_tables() -> list[tuple[str, Program]]:
    """Every table of run.toml that one program alone reads, with that program, in the order
    the spec checks them (by the table's name)."""
    return sorted(((table, entry) for entry in PROGRAMS.values() for table in entry.owns), key=lambda pair: pair[0])
