"""The program table (jobgen/program/kinds.py, issue 31): each ``job.program`` one entry, and
what the spec, the batch script and status do with a program follows from its entry."""

from __future__ import annotations

import typing

import pytest

from jobgen.program.kinds import PROGRAMS, owned_tables
from jobgen.spec.tables.run import JobSpec, RunSpec

TABLES = {"model": {"path": "/m"}, "data": {"path": "/d"}, "command": {"module": "x"}, "eval": {"path": "/e"}}


def _run(program: str, tables: typing.Iterable[str]) -> dict:
    return {"job": {"name": "x", "time": "1h", "program": program}, **{t: TABLES[t] for t in tables}}


def test_one_entry_per_program_the_spec_takes():
    assert tuple(PROGRAMS) == typing.get_args(JobSpec.model_fields["program"].annotation)
    assert all(entry.name == name for name, entry in PROGRAMS.items())


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_spec_asks_for_the_tables_the_entry_needs_and_refuses_another_s(name: str):
    entry = PROGRAMS[name]
    run = RunSpec.model_validate(_run(name, entry.needs))
    assert run.job.kind is entry and run.job.resumable == entry.resumable
    for missing in entry.needs:
        with pytest.raises(ValueError, match=f"program = '{name}' needs"):
            RunSpec.model_validate(_run(name, [t for t in entry.needs if t != missing]))
    for table, owner in owned_tables():
        if owner is not entry:
            with pytest.raises(ValueError, match=rf"\[{table}\] is only used with job.program = '{owner.name}'"):
                RunSpec.model_validate(_run(name, [*entry.needs, table]))


def test_what_each_program_is():
    """The entries as the rooms read them: only the trainer trains (memory plan, world sizes,
    max_steps), only your own program is planned per attempt and keeps its own checkpoints,
    only the doctor ends with a verdict per node; the bundled programs are started by module."""
    assert [name for name, entry in PROGRAMS.items() if entry.trains] == ["train"]
    assert [name for name, entry in PROGRAMS.items() if entry.planned] == ["command"]
    assert [name for name, entry in PROGRAMS.items() if entry.own_checkpoints] == ["command"]
    assert [name for name, entry in PROGRAMS.items() if entry.checks_nodes] == ["doctor"]
    assert [name for name, entry in PROGRAMS.items() if not entry.resumable] == ["doctor"]
    assert {name: entry.module for name, entry in PROGRAMS.items()} == {
        "train": "trainer",
        "doctor": "trainer.doctor",
        "command": "jobgen.runtime.launch",
    }
