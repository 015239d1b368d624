"""``jobgen cluster down --all`` (CI's clean-up) says "nothing to do" only when no dev cluster
of the machine was up: it once said "no dev cluster recorded" for the default state directory
right before tearing down a registered one. The teardown itself is stubbed (tests/cluster
exercises it on real clusters); what is checked is which clusters it reaches and what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from jobgen.devcluster import cli, instances, teardown
from jobgen.devcluster.state import resolve_state_dir


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine whose only recorded cluster is the registered one at tmp_path/"second"."""
    second = tmp_path / "second"
    torn: list[Path] = []
    up = {second}
    monkeypatch.setattr(teardown, "require_root", lambda what: None)
    monkeypatch.setattr(teardown, "load_state", lambda root: root if Path(root) in up else None)
    monkeypatch.setattr(teardown, "teardown", lambda state: torn.append(Path(state)) or [])
    monkeypatch.setattr(instances, "registered", lambda: [second])
    return second, torn, up


def said(result) -> str:
    return result.stdout + result.stderr


def test_down_all_tears_down_the_registered_cluster_without_saying_nothing_was_up(machine):
    second, torn, _ = machine
    result = CliRunner().invoke(cli.cluster, ["down", "--all"])
    assert result.exit_code == 0, said(result)
    assert torn == [second]
    assert "nothing to do" not in said(result) and "no dev cluster" not in said(result), said(result)


def test_down_all_with_nothing_up_says_so_once(machine):
    _, torn, up = machine
    up.clear()
    result = CliRunner().invoke(cli.cluster, ["down", "--all"])
    assert result.exit_code == 0 and torn == []
    assert said(result).count("nothing to do") == 1, said(result)


def test_down_of_one_state_dir_still_names_it_when_nothing_is_recorded(machine, tmp_path):
    result = CliRunner().invoke(cli.cluster, ["down", "--state-dir", str(tmp_path / "empty")])
    assert result.exit_code == 0
    assert f"no dev cluster recorded in {resolve_state_dir(tmp_path / 'empty')}" in said(result), said(result)
