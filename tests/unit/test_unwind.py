"""A SIGTERMed pytest runs the running test's clean-up (tests/unwind.py): a session of its own,
started with the plugin, is SIGTERMed in the middle of a test whose ``finally`` leaves a mark; a
process forked from a session still dies of SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from helpers import REPO

SESSION = textwrap.dedent(
    """
    import multiprocessing, os, pathlib, time

    OUT = pathlib.Path(os.environ["UNWIND_OUT"])

    def sleeper(running):
        running.set()
        time.sleep(60)

    def test_a_forked_child_still_dies_of_sigterm():
        fork = multiprocessing.get_context("fork")
        running = fork.Event()
        child = fork.Process(target=sleeper, args=(running,))
        child.start()
        # Once it runs its own code: with a Python handler (this one, inherited), a signal in the
        # instant after fork() is dropped by Python's clearing of the child's pending signals.
        assert running.wait(30)
        child.terminate()
        child.join(30)
        assert child.exitcode == -15

    def test_waits():
        try:
            (OUT / "started").touch()
            time.sleep(120)
        finally:
            (OUT / "cleaned-up").touch()
    """
)


def test_a_sigtermed_session_runs_the_running_tests_clean_up(tmp_path):
    (tmp_path / "test_session.py").write_text(SESSION)
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "UNWIND_OUT": str(tmp_path)}
    cmd = [sys.executable, "-m", "pytest", "-p", "unwind", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
    proc = subprocess.Popen([*cmd, "test_session.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert (tmp_path / "cleaned-up").exists(), out
    assert "KeyboardInterrupt" in out and "pytest got signal SIGTERM" in out, out
    assert "1 passed" in out, out  # the forked child's test
