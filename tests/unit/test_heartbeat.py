"""The ranks' heartbeats and the hang watch's settings (issue 35, train.hang_timeout): what a
rank writes and when, what the spec accepts, and where the batch script watches. The watch
itself runs in tests/distributed/test_hang_watch.py and on the dev cluster."""

from __future__ import annotations

import time

import pytest

from helpers import DATA, run_spec
from jobgen.launch.render import render
from jobgen.runs.heartbeat import Heartbeat, interval_for
from jobgen.spec.loader import SpecError, load_run

EVERY = 0.05


def files(directory) -> dict[str, str]:
    """Every heartbeat file there and what it holds (the step, as the watcher reads it)."""
    return {path.name: path.read_text() for path in directory.glob("rank-*")}


def settle() -> None:
    time.sleep(EVERY * 6)  # several of the writer's turns


@pytest.fixture
def heartbeat(tmp_path):
    beat = Heartbeat(tmp_path / "beats", 3, EVERY)
    yield beat
    beat.close()


def test_a_beat_is_written_with_the_newest_step_and_nothing_without_beats(heartbeat, tmp_path):
    settle()
    assert not heartbeat.path.exists()  # before the first step: nothing to judge
    for step in range(1, 50):
        heartbeat.beat(step)
    settle()
    assert files(tmp_path / "beats") == {"rank-3": "49\n"}
    written = heartbeat.path.stat().st_mtime_ns
    heartbeat.beat()  # an evaluation batch: progress, the same step
    settle()
    assert heartbeat.path.stat().st_mtime_ns > written and files(tmp_path / "beats") == {"rank-3": "49\n"}


def test_a_rank_that_stops_beating_leaves_its_file_unchanged(heartbeat):
    heartbeat.beat(7)
    settle()
    before = heartbeat.path.stat().st_mtime_ns
    settle()
    assert heartbeat.path.stat().st_mtime_ns == before  # what the watcher measures the hang by


def test_a_pause_removes_the_file_until_the_next_beat(heartbeat, tmp_path):
    heartbeat.beat(4)
    settle()
    heartbeat.pause()  # a save begins
    settle()
    assert not heartbeat.path.exists()  # however long the save takes, nothing is judged
    heartbeat.beat(5)
    settle()
    assert files(tmp_path / "beats") == {"rank-3": "5\n"}
    heartbeat.close()
    assert not heartbeat.path.exists()


def test_no_heartbeat_without_the_batch_scripts_variables(monkeypatch, tmp_path):
    monkeypatch.delenv("JOBGEN_HEARTBEAT_DIR", raising=False)
    assert Heartbeat.from_env(0) is None
    monkeypatch.setenv("JOBGEN_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("JOBGEN_HEARTBEAT_SECONDS", "soon")
    assert Heartbeat.from_env(0) is None


def test_the_interval_is_a_tenth_of_the_timeout_within_bounds():
    assert [interval_for(t) for t in (10, 20, 300, 3600)] == [1, 2, 30, 30]


def spec_file(tmp_path, tiny_model, restarts: int, **train: object):
    job = {"nodes": 2, "time": "1h", "runs_root": str(tmp_path / "runs"), "in_job_restarts": restarts}
    return run_spec(tmp_path, "r", job=job, model={"path": str(tiny_model)}, data={"path": str(DATA)}, train=train)


@pytest.mark.parametrize(
    ("train", "problem"),
    [
        ({"hang_timeout": "5s"}, "at least 10s"),
        ({"hang_timeout": "10m"}, "shorter than train.collective_timeout (10m)"),
        ({"hang_timeout": "2m", "collective_timeout": "1m"}, "shorter than train.collective_timeout (1m)"),
    ],
)
def test_a_hang_timeout_out_of_range_is_refused_naming_the_keys(tmp_path, tiny_model, train, problem):
    with pytest.raises(SpecError, match=r"train\.hang_timeout") as caught:
        load_run(spec_file(tmp_path, tiny_model, 1, **train))
    assert problem in str(caught.value)


@pytest.mark.parametrize(
    ("restarts", "train", "watched"),
    [(2, {}, 300), (2, {"hang_timeout": "45s"}, 45), (2, {"collective_timeout": "1m"}, 30), (0, {}, None)],
)
def test_the_watch_runs_where_the_task_relaunches(tmp_path, tiny_model, restarts, train, watched):
    spec = load_run(spec_file(tmp_path, tiny_model, restarts, **train))
    script = render(spec)
    assert ("watch_heartbeats &" in script) == bool(watched)
    assert ("JOBGEN_HEARTBEAT_DIR" in script) == bool(watched)
    if watched:
        assert f"HANG_TIMEOUT={watched}\n" in script
        assert f"JOBGEN_HEARTBEAT_SECONDS={interval_for(watched)}\n" in script
        assert '--job-name="jobgen-launch-$JOBGEN_LAUNCH"' in script  # the step the watcher kills
