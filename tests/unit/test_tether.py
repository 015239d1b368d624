"""jobgen.runtime.tether: a step inside a podman container notices that the ``podman run`` Slurm
tracks has gone (Slurm SIGKILLed the step; conmon keeps the container), once, and not for a pid
that another process took over. The torchrun wrapper's use of it is tests/distributed/test_container_tether.py."""

from __future__ import annotations

import subprocess
import threading
import time

from jobgen.runtime.tether import start_time, tethered_pid, watch


def write_stat(proc, pid: int, started: int, state: str = "S") -> None:
    (proc / str(pid)).mkdir(exist_ok=True)
    rest = " ".join(["0"] * 17)
    # "pid (comm) state ppid ... starttime": the 22nd field; the command name holds a ')' and spaces.
    (proc / str(pid) / "stat").write_text(f"{pid} (podman (run) x) {state} 1 {rest} {started} 0 0\n")


def test_the_start_time_is_the_22nd_field_after_the_command_name(tmp_path):
    write_stat(tmp_path, 40, 123456)
    assert start_time(40, tmp_path) == 123456
    write_stat(tmp_path, 41, 99, state="Z")  # ended, not reaped: gone for the tether
    assert start_time(41, tmp_path) is None
    assert start_time(42, tmp_path) is None


def test_the_pid_comes_from_the_runtimes_variable_only_when_it_is_one():
    assert tethered_pid({"JOBGEN_TETHER_PID": "4242"}) == 4242
    assert tethered_pid({}) is None
    assert tethered_pid({"JOBGEN_TETHER_PID": "$$"}) is None  # a shell that did not expand it
    assert tethered_pid({"JOBGEN_TETHER_PID": "0"}) is None


def test_a_tethered_process_that_ends_calls_back_once():
    podman = subprocess.Popen(["sleep", "60"])
    lost = threading.Event()
    calls = []
    thread = watch(podman.pid, lambda: (calls.append(time.monotonic()), lost.set()), poll=0.05)
    assert thread is not None
    time.sleep(0.3)
    assert not lost.is_set()  # alive: nothing to do
    podman.kill()
    podman.wait()
    assert lost.wait(5)
    thread.join(5)
    assert len(calls) == 1


def test_a_pid_taken_over_by_another_process_is_the_tether_lost(tmp_path):
    write_stat(tmp_path, 50, 1000)
    lost = threading.Event()
    thread = watch(50, lost.set, poll=0.05, proc=tmp_path)
    assert thread is not None
    time.sleep(0.2)
    assert not lost.is_set()
    write_stat(tmp_path, 50, 2000)  # same pid, a later process
    assert lost.wait(5)


def test_no_thread_for_a_pid_that_is_not_there_to_begin_with(tmp_path):
    assert watch(77, lambda: None, proc=tmp_path) is None
