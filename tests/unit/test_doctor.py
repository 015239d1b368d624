"""`jobgen doctor`'s report comes from the doctor.json the doctor program writes, never from
scraping the job's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobgen.base.exit_codes import ExitCode
from jobgen.launch.doctor import report
from jobgen.runs.rundir import RunDir

TABLE = [
    "node         ranks      device  ...",
    "-" * 20,
    "node1        0,1        cpu     ...  OK",
    "RESULT: all 2 ranks OK on 1 node(s)",
]


def _run(tmp_path: Path, verdict: dict | None, log: str = "") -> RunDir:
    run = RunDir(tmp_path / "doc")
    run.logs.mkdir(parents=True)
    (run.logs / "doc-7.out").write_text(log)
    if verdict is not None:
        (run.path / "doctor.json").write_text(json.dumps(verdict))
    return run


@pytest.mark.parametrize("ok, code", [(True, ExitCode.OK), (False, ExitCode.DOCTOR_FAILED)])
def test_report_prints_the_table_of_doctor_json(tmp_path: Path, capsys, ok, code):
    # The log says something else entirely: it is not read.
    run = _run(tmp_path, {"ok": ok, "table": TABLE}, log="[default0]:jobgen doctor:\n[default0]:RESULT: FAILED\n")
    assert report(run, 7) == int(code)
    out = capsys.readouterr()
    assert out.out.splitlines() == ["jobgen doctor:", *TABLE] and out.err == ""


def test_report_names_the_failing_nodes_as_an_exclude_line(tmp_path: Path, capsys):
    verdict = {
        "ok": False,
        "table": TABLE,
        "failed_nodes": {"node3": ["all_reduce: timed out"]},
        "version_mismatch": {"node1": ["torch 2.12.0 (others 2.13.0)"]},
    }
    assert report(_run(tmp_path, verdict, log=""), 7) == int(ExitCode.DOCTOR_FAILED)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        "jobgen doctor: to keep jobs off the failing nodes: --exclude=node1,node3"
        '  (in run.toml: [job] exclude = ["node1", "node3"])'
    )


def test_report_without_doctor_json_shows_the_end_of_the_log(tmp_path: Path, capsys):
    lines = [f"line {i}" for i in range(40)]
    run = _run(tmp_path, None, log="\n".join(lines) + "\n")
    assert report(run, 7) == int(ExitCode.DOCTOR_FAILED)
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        f"jobgen doctor: job 7 produced no report; last lines of {run.logs / 'doc-7.out'}:",
        *lines[-25:],
    ]


@pytest.mark.torch
def test_the_doctor_program_writes_its_table_into_the_verdict():
    pytest.importorskip("torch")
    from trainer.doctor import summarise

    rank = {
        "node": "node1",
        "device": "cpu",
        "torch": "2.x",
        "nccl": None,
        "python": "3.x",
        "errors": {},
        "checks": {"bandwidth": 1.5},
    }
    lines, verdict = summarise([{**rank, "rank": 0}, {**rank, "rank": 1}], expected_world=2)
    assert verdict["ok"] and verdict["table"] == lines and lines[-1] == "RESULT: all 2 ranks OK on 1 node(s)"
    json.dumps(verdict)  # doctor.json holds it as it is
