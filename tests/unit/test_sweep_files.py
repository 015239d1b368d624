"""A sweep's own files (jobgen.runs.sweep_files): where a point's directory is, by construction never
one of the sweep's files nor outside the sweep; sweep.json read into one validated structure;
and a sweep submitted before points/ (format 1, points beside sweep.json) still read, stopped,
claimed and continued, refusing only new points. Damaged files through the commands:
tests/unit/test_sweep_runs.py and test_sweep_claim.py."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from helpers import jobgen, small_sweep
from jobgen.launch.submit import SubmitError
from jobgen.runs.sweep_files import (
    DOTTED_KEY,
    FLAT,
    FORMAT,
    PROGRAMS,
    SWEEP_FILES,
    SweepFileError,
    parse_index,
    point_dir,
    read_index,
)
from jobgen.spec.tables import sweep as sweep_spec
from jobgen.spec.tables.run import JobSpec
from jobgen.sweep import claim as sweep_claim
from jobgen.sweep.points import load_sweep
from jobgen.sweep.status import sweep_status
from jobgen.sweep.submit import submit_sweep


def submit(path: Path):
    return submit_sweep(load_sweep(path), source_text=path.read_text(), skip_preflight=True)


def test_the_programs_and_override_keys_of_a_point_are_the_specs():
    # The claim (standard library only) cannot import the spec: the two lists are one.
    assert typing.get_args(JobSpec.model_fields["program"].annotation) == PROGRAMS
    assert sweep_spec._DOTTED.pattern == DOTTED_KEY.pattern


@pytest.mark.parametrize("name", SWEEP_FILES)
def test_no_point_name_is_one_of_the_sweeps_files(tmp_path, name):
    sweep = tmp_path / "sweep"
    if name.startswith("."):  # not a point's name at all
        with pytest.raises(SweepFileError):
            point_dir(sweep, name)
        return
    assert point_dir(sweep, name) == sweep / "points" / name  # under points/, whatever its name
    with pytest.raises(SweepFileError, match="not a point's name"):
        point_dir(sweep, name, FLAT)  # beside sweep.json, it would be one


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../x", "", "-a", "a" * 65, "a b", "é"])
def test_a_point_name_is_a_plain_name(tmp_path, name):
    with pytest.raises(SweepFileError, match="not a point's name"):
        point_dir(tmp_path, name)
    index = {"points": [{"name": name, "overrides": {}, "program": "train", "attempts": 1}]}
    with pytest.raises(SweepFileError, match=r"points\[0\]\.name"):
        parse_index(tmp_path, index)


def test_the_index_reads_back_what_it_writes_with_job_ids_as_numbers(tmp_path):
    data = {
        "format": FORMAT,
        "name": "lrs",
        "max_parallel": 2,
        "points": [{"name": "a", "overrides": {"train.lr": 0.1}, "program": "train", "attempts": 3}],
        "jobs": [{"job_id": "41", "options": ["--array=1-3%2"]}],  # a job id written as text reads as one
    }
    index = parse_index(tmp_path, data)
    assert index.jobs[0].job_id == 41 and index.point_dir("a") == tmp_path / "points" / "a"
    assert parse_index(tmp_path, index.to_json()) == index


def flatten(sweep: Path) -> None:
    """The sweep as jobgen before points/ wrote it: each point beside sweep.json, its spec's
    runs_root the sweep, and sweep.json's entries naming their files (format 1)."""
    index = json.loads((sweep / "sweep.json").read_text())
    for entry in index["points"]:
        run = sweep / entry["name"]
        (sweep / "points" / entry["name"]).rename(run)
        spec = json.loads((run / "spec.json").read_text())
        spec["run"]["job"]["runs_root"] = str(sweep)
        (run / "spec.json").write_text(json.dumps(spec))
        entry.pop("program")
        entry |= {
            "dir": str(run),
            "script": str(run / "train.sbatch"),
            "log": str(run / "logs" / f"{entry['name']}-{{job_id}}.out"),
            "done": str(run / "done"),
            "failed": str(run / "failed"),
            "kill": str(run / "switches" / "kill"),
        }
    (sweep / "points").rmdir()
    (sweep / "sweep.json").write_text(json.dumps({**index, "format": 1}))


def test_a_sweep_of_format_1_is_read_stopped_claimed_and_continued_but_takes_no_new_point(
    tmp_path, sbatch_calls, capsys
):
    path = small_sweep(tmp_path)
    submit(path)
    sweep = tmp_path / "runs" / "lrs"
    flatten(sweep)
    assert [p["run_dir"] for p in sweep_status(sweep)["points"]] == [str(sweep / "lr-0.001"), str(sweep / "lr-0.002")]
    jobgen("stop", "lrs/lr-0.002", env={"JOBGEN_RUNS_ROOT": str(sweep.parent)}, check=True)
    assert (sweep / "lr-0.002" / "switches" / "kill").is_file()
    argv = ["--sweep", str(sweep), "--job", "42", "--array-job", "41", "--task", "1", "--live", "42"]
    assert sweep_claim.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1:3] == [str(sweep / "lr-0.001"), str(sweep / "lr-0.001/train.sbatch")]
    # Submitted again: its points continue where they are, and sweep.json keeps format 1 with
    # the paths an older jobgen's claim (an array queued before the upgrade) reads.
    submit(path)
    index = json.loads((sweep / "sweep.json").read_text())
    assert index["format"] == 1 and [j["job_id"] for j in index["jobs"]] == [101, 102]
    assert index["points"][0]["dir"] == str(sweep / "lr-0.001") and not (sweep / "points").exists()
    assert read_index(sweep).point_dir("lr-0.001") == sweep / "lr-0.001"
    path.write_text(path.read_text().replace("[1e-3, 2e-3]", "[1e-3, 2e-3, 4e-3]"))
    with pytest.raises(SubmitError) as info:
        submit(path)
    words = str(info.value.findings)
    assert "older jobgen" in words and "lr-0.004" in words and "another job.name" in words, words
    assert not (sweep / "lr-0.004").exists() and not (sweep / "points").exists()
