"""The trainer's end and the snapshot in flight (trainer.checkpoints.snapshots.Snapshots.close):
a snapshot whose copy to the mirror's partner never completes (the partner's node is gone, and
the exchange waits for the group's timeout: train.collective_timeout, minutes) holds the rank's
end only so long; the trainer then leaves the process group to the process's exit instead of
destroying it under the writer. A world of one on gloo, the mirror played by a stand-in."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from test_snapshot_trust import world_of_one  # noqa: F401 (a fixture)

from small_checkpoints import trainer_state

pytestmark = pytest.mark.torch

STEP = 4


class StuckMirror:
    """A partner that never answers: the exchange returns only once released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def exchange(self, data: bytes, step: int) -> list[tuple[int, bytes]]:
        self.release.wait(120)
        return []


def _snapshots(world, tmp_path):
    import torch

    from trainer.checkpoints.snapshots import Snapshots

    (tmp_path / "shm").mkdir()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    snapshots = Snapshots(tmp_path / "shm" / f"jobgen-{os.getuid()}" / "run" / "7.0", world, every_steps=STEP)
    return snapshots, model, optimizer


def test_the_end_waits_for_a_snapshot_stuck_in_its_mirror_only_so_long(world_of_one, tmp_path, caplog):  # noqa: F811
    snapshots, model, optimizer = _snapshots(world_of_one, tmp_path)
    snapshots.peers = StuckMirror()
    snapshots.take(STEP, model, optimizer, trainer_state(STEP))
    began = time.monotonic()
    outcome: list[bool] = []
    closing = threading.Thread(target=lambda: outcome.append(snapshots.close(timeout=0.5)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoints.snapshots"):
        closing.start()
        closing.join(20)  # before: close() waited for the writer however long it took
    try:
        assert outcome == [False] and time.monotonic() - began < 20
        assert "left behind" in caplog.text and "mirror partner gone" in caplog.text
    finally:
        snapshots.peers.release.set()
        closing.join(20)


def test_a_snapshot_that_completes_is_waited_for_and_kept(world_of_one, tmp_path):  # noqa: F811
    snapshots, model, optimizer = _snapshots(world_of_one, tmp_path)
    snapshots.take(STEP, model, optimizer, trainer_state(STEP))
    assert snapshots.close(timeout=30) is True
    assert [step for rank, step in snapshots.held()] == [STEP]


def test_the_process_group_is_left_to_the_exit_when_a_writer_was_left_behind():
    from trainer.__main__ import Progress

    class Ended:
        snapshot_left_behind = True

    assert Progress(trainer=Ended()).snapshot_left_behind
    assert not Progress().snapshot_left_behind  # no Trainer built (a crash before): nothing in flight
