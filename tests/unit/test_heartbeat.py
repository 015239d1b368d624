"""The ranks' heartbeats and the hang watch's settings (issue 35, train.hang_timeout): what a
rank writes and when, what the spec accepts, and where the batch script watches. The watch
itself runs in tests/distributed/test_hang_watch.py and on the dev cluster."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from helpers import DATA, run_spec, script_supervisor
from jobgen.launch.render import render
from jobgen.runs.heartbeat import Heartbeat, interval_for, newest_step
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
    settings = script_supervisor(script)
    assert settings["hang_timeout"] == watched
    assert settings["heartbeat_every"] == (interval_for(watched) if watched else None)
    assert '--job-name="jobgen-launch-$JOBGEN_LAUNCH"' in script  # the step the supervisor kills on a hang


# --------------------------------------------------------------------------- a directory others may write (issue 45)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["rank-3", ".rank-3.tmp"])
@pytest.mark.parametrize("kind", ["a link to a file of yours", "a FIFO"])
def test_a_link_or_fifo_planted_at_a_heartbeat_name_is_never_written_through(tmp_path, planted, kind):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    beats = tmp_path / "beats"
    beats.mkdir(mode=0o755)
    if kind == "a FIFO":
        os.mkfifo(beats / planted)
    else:
        os.symlink(victim, beats / planted)
    heartbeat = Heartbeat(beats, 3, EVERY)
    try:
        heartbeat.beat(11)
        settle()
        assert victim.read_text() == "mine\n"
        assert stat.S_ISREG((beats / "rank-3").lstat().st_mode) and files(beats) == {"rank-3": "11\n"}
        heartbeat.pause()
        assert not (beats / "rank-3").exists() and victim.exists()
    finally:
        heartbeat.close()


def test_a_heartbeat_directory_others_may_write_or_a_link_keeps_no_heartbeat(tmp_path, capfd):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    os.symlink(shared, tmp_path / "link")
    for directory in (shared, tmp_path / "link"):
        heartbeat = Heartbeat(directory, 0, EVERY)
        heartbeat.beat(1)
        settle()
        heartbeat.close()
        assert not (shared / "rank-0").exists()
    said = capfd.readouterr().err.splitlines()
    assert said == [
        f"jobgen: rank keeps no heartbeat: {shared}: others may write it (mode 777): files planted there would be "
        "taken for yours; `chmod go-w` it if you trust what is in it, else remove it",
        f"jobgen: rank keeps no heartbeat: {tmp_path / 'link'}: is a symbolic link: jobgen follows no link here "
        "and writes only into a directory",
    ]


@pytest.mark.timeout(60)
def test_the_watchers_step_reader_counts_only_the_users_own_regular_files(tmp_path):
    beats = tmp_path / "beats"
    beats.mkdir(mode=0o755)
    (beats / "rank-0").write_text("41\n")
    (beats / "rank-1").write_text("40\n")
    os.mkfifo(beats / "rank-2")  # the old `cat rank-*` waited on it for good
    (tmp_path / "elsewhere").write_text("999999\n")
    os.symlink(tmp_path / "elsewhere", beats / "rank-3")
    (beats / "rank-4").write_text("7" * 100)  # no step a rank writes
    (beats / "rank-5").write_text("not a step\n")
    if os.geteuid() == 0:
        (beats / "rank-6").write_text("5000\n")
        os.chown(beats / "rank-6", 54321, -1)
    assert newest_step(beats) == 41
    done = subprocess.run(
        [sys.executable, "-m", "jobgen.runs.heartbeat", str(beats)], capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "41\n", "")
    os.chmod(beats, 0o777)
    done = subprocess.run(
        [sys.executable, "-m", "jobgen.runs.heartbeat", str(beats)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "others may write it" in done.stderr
