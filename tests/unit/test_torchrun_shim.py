"""jobgen.runtime.torchrun's own pieces: which processes are its workers (from /proc's stat
lines, whose command names may hold spaces and parentheses), the status a SystemExit gives, and
the workers' grace as torch reads it. The end-to-end behaviour is tests/distributed/test_torchrun_exit.py.
"""

from __future__ import annotations

import pytest

from jobgen.runtime.torchrun import DEFAULT_SHUTDOWN_SECONDS, children, exit_code, shutdown_seconds


def stat(proc, pid: int, comm: str, ppid: int, state: str = "S") -> None:
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} {ppid} {pid} {pid} 0 -1 4194560 0 0\n")


def test_children_are_read_from_the_stat_lines_whatever_the_command_name(tmp_path):
    stat(tmp_path, 100, "python", 1)
    stat(tmp_path, 101, "python3 (worker) 7", 100)  # a name with spaces and a ')' of its own
    stat(tmp_path, 102, "zombie", 100, state="Z")  # ended, not yet reaped: still ours to reap
    stat(tmp_path, 103, "grandchild", 101)
    stat(tmp_path, 104, "100", 2)  # a name that looks like the parent's pid
    (tmp_path / "self").mkdir()  # not a process directory
    (tmp_path / "105").mkdir()  # a process that ended while the directory was read: no stat file
    assert children(100, tmp_path) == [101, 102]
    assert children(101, tmp_path) == [103]
    assert children(999, tmp_path) == []


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), ("usage: torchrun ...", 1)])
def test_a_system_exit_gives_the_status_python_would(code, status, capsys):
    assert exit_code(SystemExit(code)) == status
    assert capsys.readouterr().err == ("usage: torchrun ...\n" if isinstance(code, str) else "")


@pytest.mark.parametrize(
    ("environ", "seconds"),
    [
        ({}, DEFAULT_SHUTDOWN_SECONDS),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "170"}, 170.0),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "-5"}, 0.0),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, DEFAULT_SHUTDOWN_SECONDS),
    ],
)
def test_the_workers_grace_is_torchs_shutdown_timeout(environ, seconds):
    assert shutdown_seconds(environ) == seconds
