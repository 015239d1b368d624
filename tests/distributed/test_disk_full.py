"""A full disk during a checkpoint save: the cause reaches the batch script (and so the job's
comment and jobgen status) although nothing new can be written to the run's filesystem.

The runs root is a real tmpfs of a few MiB (root mounts it), filled once the trainer has
started, before its first save."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers import checkpoints, make_run, read_jsonl, torchrun, wait_for
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch


@pytest.fixture()
def small_disk(tmp_path: Path):
    mount = tmp_path / "runs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.fail("needs root to mount a tmpfs (the CI machine runs as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> None:
    """Write until the filesystem refuses a byte more."""
    with open(directory / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass


def test_a_full_disk_during_a_save_names_itself_in_the_exit_record(tmp_path: Path, small_disk: Path, tiny_model):
    run = make_run(
        tmp_path,
        tiny_model,
        max_steps=100_000,
        save_every_steps=0,
        save_every="4s",  # the first save comes after the disk is full
        log_every_steps=100_000,
        site={"profile": "local", "paths": {"data_cache": str(tmp_path / "cache")}},  # off the small disk
    )
    env = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0", "JOBGEN_JOB_END_TIME": str(int(time.time()) + 3600)}
    proc = torchrun(run, env=env, background=True)
    record = run / "logs" / "exit-code.4242.0"
    wait_for(lambda: read_jsonl(run / "tasks.jsonl"), 120, "the first step", process=proc)
    assert record.read_text().strip() == ""  # room kept for the exit record, read as none yet
    fill(small_disk)
    out, _ = proc.communicate(timeout=180)

    code, words = record.read_text().splitlines()[:2]
    assert int(code) == ExitCode.CRASHED, out[-3000:]
    assert words.startswith(f"crashed: no space left on {small_disk} (writing "), words
    assert str(run) in words
    assert f"exit 1: crashed: no space left on {small_disk}" in out
    assert checkpoints(run) == []  # no checkpoint half-written under a final name
