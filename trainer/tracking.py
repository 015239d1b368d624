"""Experiment tracking: TensorBoard and Weights & Biases, as ``train.report_to`` asks.

Rank 0 only, at each logged step, the same numbers as ``metrics.jsonl``. A tracker that
fails (not installed, no disk, no network, a W&B server error) is switched off with one
warning: tracking never stops training.

- **TensorBoard**: event files under ``<run>/tensorboard/`` (``RunDir.tensorboard``). Each
  job opens a writer with ``purge_step`` at the step it resumed from, so the steps an
  earlier job logged past its last checkpoint (lost in a crash, trained again now) are
  dropped and the curve stays one continuous line.
- **W&B**: one W&B run per jobgen run. Its id is created once and kept in the run
  directory (``RunDir.wandb_id``), and every array task and requeue resumes it
  (``resume="allow"``). Without a route to the W&B server from the node (or with
  ``WANDB_MODE=offline``) it logs offline under ``<run>/wandb/`` and prints the command that
  uploads it. The API key comes from the job's environment (``WANDB_API_KEY``, exported by
  sbatch from the submitting shell) or ``~/.netrc``; jobgen never writes it anywhere.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import Any

from jobgen.base.atomic import write_text_atomic
from jobgen.runs.rundir import RunDir
from jobgen.runs.sweep_runs import sweep_name

log = logging.getLogger("trainer.tracking")

# Where W&B's client sends data unless WANDB_BASE_URL says otherwise.
WANDB_HOST = ("api.wandb.ai", 443)


class Tracker:
    """One backend. ``log`` and ``close`` never raise: the first failure switches it off."""

    name = "tracker"

    def __init__(self) -> None:
        self.failed = False

    def log(self, step: int, values: dict[str, float], section: str = "train") -> None:
        self._guard(self._log, step, values, section)

    def table(self, step: int, tag: str, rows: list[tuple[str, str]]) -> None:
        """(prompt, completion) rows, e.g. the samples of an evaluation."""
        self._guard(self._table, step, tag, rows)

    def close(self) -> None:
        self._guard(self._close)

    def _guard(self, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of a tracker must leave training alone
            self.failed = True
            log.warning("%s logging switched off for this job: %s: %s", self.name, type(exc).__name__, exc)

    def _log(self, step: int, values: dict[str, float], section: str) -> None:
        raise NotImplementedError

    def _table(self, step: int, tag: str, rows: list[tuple[str, str]]) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run: RunDir, start_step: int):
        super().__init__()
        from torch.utils.tensorboard import SummaryWriter

        run.tensorboard.mkdir(parents=True, exist_ok=True)
        # purge_step: events at or after it, from jobs that got further than their last
        # checkpoint, are discarded; this job logs those steps again.
        self.writer = SummaryWriter(log_dir=str(run.tensorboard), purge_step=start_step + 1)

    def _log(self, step: int, values: dict[str, float], section: str) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{section}/{key}", value, step)
        self.writer.flush()

    def _table(self, step: int, tag: str, rows: list[tuple[str, str]]) -> None:
        # The text tab renders Markdown: one table, each cell's pipes and newlines escaped.
        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", "<br>") or " "

        lines = ["| prompt | completion |", "|---|---|", *(f"| {cell(p)} | {cell(c)} |" for p, c in rows)]
        self.writer.add_text(tag, "\n".join(lines), step)
        self.writer.flush()

    def _close(self) -> None:
        self.writer.close()


def wandb_reachable(timeout: float = 3.0) -> bool:
    """Whether this node can open a connection to the W&B server."""
    base = os.environ.get("WANDB_BASE_URL", "")
    host, port = WANDB_HOST
    if base:
        from urllib.parse import urlparse

        parsed = urlparse(base)
        host, port = parsed.hostname or host, parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wandb_run_id(run: RunDir) -> str:
    """The W&B run id of this jobgen run: made once, then read by every later job."""
    path = run.wandb_id
    if path.is_file():
        existing = path.read_text().strip()
        if existing:
            return existing
    new = secrets.token_hex(4)
    write_text_atomic(path, new + "\n")
    return new


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, run: RunDir, name: str, project: str, config: dict[str, Any], group: str | None = None):
        super().__init__()
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_reachable() else "offline")
        run.wandb_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=name,
            group=group,  # a sweep's points: one group per sweep, one run per point
            id=wandb_run_id(run),
            resume="allow",
            dir=str(run.wandb_dir),
            mode=mode,
            config=config,
        )
        self.mode = mode
        if mode == "offline":
            log.info(
                "W&B is offline (no route to its server from this node): upload later with "
                "`wandb sync %s/wandb/offline-run-*`",
                run.path,
            )

    def _log(self, step: int, values: dict[str, float], section: str) -> None:
        self.run.log(values if section == "train" else {f"{section}/{k}": v for k, v in values.items()}, step=step)

    def _table(self, step: int, tag: str, rows: list[tuple[str, str]]) -> None:
        import wandb

        self.run.log({tag: wandb.Table(columns=["prompt", "completion"], data=[list(r) for r in rows])}, step=step)

    def _close(self) -> None:
        self.run.finish()


class Trackers:
    """Every tracker ``report_to`` names (an empty list: none), for rank 0."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, step: int, values: dict[str, Any], section: str = "train") -> None:
        # A table of numbers (a mixture's tokens per source) is one series per entry: key/name.
        flat = {f"{k}/{name}": n for k, v in values.items() if isinstance(v, dict) for name, n in v.items()}
        numbers = {
            k: float(v)
            for k, v in {**values, **flat}.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for tracker in self.trackers:
            tracker.log(step, numbers, section)

    def table(self, step: int, tag: str, rows: list[tuple[str, str]]) -> None:
        for tracker in self.trackers:
            tracker.table(step, tag, rows)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(
    report_to: list[str],
    run: RunDir,
    *,
    name: str,
    project: str,
    start_step: int,
    config: dict,
    group: str | None = None,
) -> Trackers:
    """Start what ``report_to`` asks for; one that cannot start is left out with a warning."""
    out: list[Tracker] = []
    for backend in report_to:
        try:
            if backend == "tensorboard":
                out.append(TensorBoardTracker(run, start_step))
            elif backend == "wandb":
                out.append(WandbTracker(run, name, project, config, group))
        except Exception as exc:  # noqa: BLE001 - a missing package or a server error must not stop training
            log.warning("%s logging is off for this job: %s: %s", backend, type(exc).__name__, exc)
    return Trackers(out)


def trackers_for_run(spec, run: RunDir, start_step: int, *, enabled: bool) -> Trackers:
    """The trackers ``train.report_to`` asks for (none where not ``enabled``: ranks but 0)."""
    train = spec.run.train
    if not enabled or not train.report_to:
        return Trackers([])
    return open_trackers(
        train.report_to,
        run,
        name=spec.run.job.name,
        project=train.wandb_project,
        start_step=start_step,
        config=spec.run.model_dump(mode="json", exclude={"env"}),
        group=sweep_name(run),
    )
