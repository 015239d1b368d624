"""Sharded checkpoints with torch.distributed.checkpoint, written so none is ever half-complete.

Layout under ``<run_dir>/checkpoints/``::

    step-00000120/            a complete checkpoint (only ever created by a rename)
        .metadata, __*_*.distcp   model + optimizer, sharded by DCP (DDP or FSDP2)
        trainer_state.json        step, tokens, sampler position, scheduler, seed
        rng-rank00000.pt ...      each rank's RNG streams
    .tmp-step-00000130/       a save in progress (or cut short): never loaded
    broken-step-00000110-<time>/  failed to load while an older one loaded: set aside
    latest                    name of the newest complete checkpoint, for humans and export

A save writes everything into ``.tmp-step-N`` (every file fsynced), waits until
every rank is done, then rank 0 renames it to ``step-N``, then updates ``latest``,
then renames the oldest beyond ``keep`` (but never the best by eval loss, ``protected``)
to ``.tmp-deleting-*`` and deletes them in a
background thread (unlinking gigabytes takes seconds that training need not wait for;
one cut short is a ``.tmp-*`` like any other and goes at the next start). Loading walks complete checkpoints from
the newest; one that fails to load on any rank is reported and the previous one is
tried. When an older one loads, the newer ones that failed are renamed
``broken-*`` (with ``broken.json`` saying why), so they are never counted, resumed,
"already saved" or exported again; ``jobgen status`` lists them. When none loads,
nothing is renamed: the cause is then more likely the spec or the filesystem than
every checkpoint at once, and the run stops (exit 16) rather than start over.

Everything a checkpoint holds is read as untrusted input (a teammate may write the runs
root): the shards through trainer.checkpoints.reader; ``trainer_state.json`` and each RNG file
through trainer.checkpoints.state_files (regular files of bounded size, every value of the type
the trainer writes, each RNG stream tried on a generator of its own). All of it
is read and checked on every rank before anything is restored: a damaged file makes its
checkpoint one that does not load (set aside as above), never a crash in the middle of a
restore.

Every decision here that depends on a clock or on what a directory holds (a save
being due, a step being saved already, the list of checkpoints) is taken once and
agreed by all ranks, or ranks would enter different collectives and hang.

This module owns the save and load protocol and what a checkpoint holds; the
directory names above are the run directory's layout, spelled in jobgen.runs.rundir
(``checkpoint_name``, ``checkpoint_step``, the ``CHECKPOINT_*`` prefixes).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from jobgen.base.atomic import fsync_dir, write_json_atomic, write_text_atomic
from jobgen.runs.rundir import (
    CHECKPOINT_BROKEN_PREFIX,
    CHECKPOINT_TMP_PREFIX,
    broken_checkpoints_in,
    checkpoint_name,
    complete_checkpoints_in,
)
from trainer.checkpoints.reader import (
    load,
    unreadable_cause,
)
from trainer.checkpoints.state_files import load_rng, load_trainer_state, save_rng, set_rng_state
from trainer.distributed import DistEnv, all_gather_object, barrier, broadcast_object, reduce_max

log = logging.getLogger("trainer.checkpoints.checkpointer")

# Files (and threads) each rank writes its part of a checkpoint with. One thread leaves the
# disk idle while it serialises, checksums and fsyncs; measured by bench/checkpoint_cost.py
# on the dev machine, 2 threads wrote a 2.6 GB checkpoint in 4.1 s against 6.5 s for 1, and 4
# no slower. The threads wait on I/O with the GIL released, so they cost no training cores.
WRITER_THREADS = 4


def storage_writer(path: Path, *, reuse_staging: bool = False) -> dcp.FileSystemWriter:
    """DCP's file writer. ``reuse_staging`` (async saves of GPU tensors) keeps the pinned host
    copy it stages into for the next save: allocating gigabytes of pinned memory takes seconds
    per save, and a pageable copy runs at a fraction of the bus's speed. It costs one copy of
    this rank's state in host memory for the whole run."""
    # sync_files (the default) fsyncs every file: the rename that publishes the checkpoint
    # must never make visible data a node crash could still lose.
    return dcp.FileSystemWriter(
        str(path), thread_count=WRITER_THREADS, sync_files=True, cache_staged_state_dict=reuse_staging
    )


class ResumeFailed(RuntimeError):
    """Checkpoints exist but none of them loads; the run must not silently start over."""


def describe_load_error(exc: BaseException) -> str:
    """One line for a failed load: DCP wraps the real error (with a traceback in its text). A
    refused or unreadable file (trainer.checkpoints.reader) is its own message: it names the file."""
    unreadable = unreadable_cause(exc)
    if unreadable is not None:
        return " ".join(str(unreadable).split())
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def state_dict_options(model: torch.nn.Module) -> StateDictOptions:
    """LoRA: only the adapters are trained, so only they are checkpointed and loaded; the
    frozen base weights come from the model path. Full fine-tuning loads strictly."""
    frozen = any(not p.requires_grad for p in model.parameters())
    # A pipeline's ranks hold different parameters (trainer.parallel.pipeline.StageModule): unflattened,
    # the optimizer's param_groups would name each rank's own under one key, which the stages
    # would overwrite in each other's checkpoint. Flattened, every entry is keyed by name.
    flatten = bool(getattr(model, "flat_optimizer_state", False))
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen, flatten_optimizer_state_dict=flatten)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, newest first. A directory is complete iff it has its final name."""
    return [p for _, p in reversed(complete_checkpoints_in(root))]


@dataclass
class _Pending:
    future: Future
    tmp: Path
    final: Path
    started: float


class Checkpointer:
    """Decides when to save, saves, finishes async saves, loads with fallback."""

    def __init__(
        self, root: Path, env: DistEnv, *, keep: int, every_steps: int, every_seconds: int, async_save: bool = False
    ):
        self.root = root
        self.env = env
        self.keep = keep
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.async_save = async_save
        self.last_save = time.monotonic()
        self.save_seconds: list[float] = []  # wall time of each save, staging to rename
        self.blocking_seconds: list[float] = []  # how long training was held up by each save
        self._pending: _Pending | None = None
        self._deleting: threading.Thread | None = None
        # The best checkpoint by eval loss ([eval]): kept whatever its age, besides the newest `keep`.
        self.protected: str | None = None
        # Background saves talk on their own gloo group, never interleaving with training collectives.
        self._group = dist.new_group(backend="gloo") if async_save else None
        # One writer for every background save, so that its staging buffers are reused.
        on_gpu = env.device.type == "cuda"
        self._async_writer = storage_writer(root, reuse_staging=True) if async_save and on_gpu else None
        if env.is_main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{CHECKPOINT_TMP_PREFIX}*"):
                what = "a deletion" if stale.name.startswith(f"{CHECKPOINT_TMP_PREFIX}deleting-") else "a save"
                log.warning("removing %s: %s that never completed", stale, what)
                shutil.rmtree(stale, ignore_errors=True)
        barrier()

    # ------------------------------------------------------------------ saving

    def wants_save(self, step: int) -> bool:
        """This rank's view of whether a periodic save is due. Rank-local (its own clock):
        the loop combines every rank's view in its step-boundary all-reduce, so all ranks
        save on the same step or none does."""
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        by_time = self.every_seconds > 0 and time.monotonic() - self.last_save >= self.every_seconds
        return by_steps or by_time

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        trainer_state: dict[str, Any],
        *,
        blocking: bool = False,
    ) -> Path:
        """Save step ``step``; returns the final path. With async_save and not ``blocking``,
        returns once the state is staged; ``poll``/``wait`` complete it later."""
        final = self.root / checkpoint_name(step)
        self.wait()  # one save in flight at a time
        # Rank 0 looks, every rank follows: a directory listing seen differently by two
        # ranks (NFS attribute caches) would send them into different collectives.
        if broadcast_object(self.env, final.exists() if self.env.is_main else None):
            return final  # this step is already saved (e.g. a stop right after a periodic save)
        started = time.monotonic()
        tmp = self.root / f"{CHECKPOINT_TMP_PREFIX}{final.name}"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        save_rng(tmp / f"rng-rank{self.env.rank:05d}.pt")
        if self.env.is_main:
            write_json_atomic(tmp / "trainer_state.json", trainer_state)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
        state = {"model": model_sd, "optim": optim_sd}
        if self.async_save and not blocking:
            writer = self._async_writer or storage_writer(tmp)
            future = dcp.async_save(state, checkpoint_id=str(tmp), storage_writer=writer, process_group=self._group)
            self._pending = _Pending(future, tmp, final, started)
            self.blocking_seconds.append(time.monotonic() - started)
            return final
        dcp.save(state, storage_writer=storage_writer(tmp))
        self._complete(tmp, final, started)
        self.blocking_seconds.append(time.monotonic() - started)
        return final

    def poll(self) -> None:
        """Complete a background save if every rank has finished writing it (collective while
        a save is pending). Every rank starts a save at the same step and completes it in the
        same call, so a rank with none pending knows that no rank has one: no all-reduce for
        the steps between saves."""
        if not self.async_save or self._pending is None:
            return
        (writing_anywhere,) = reduce_max(self.env, [int(not self._pending.future.done())])
        if not writing_anywhere:
            self.wait()

    def wait(self) -> None:
        """Block until a background save is written and renamed into place (collective)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.future.result()
        self._complete(pending.tmp, pending.final, pending.started)

    def close(self) -> None:
        """At exit (collective): finish a background save and the deletion of surplus
        checkpoints, so that a clean exit leaves nothing half-written or half-deleted."""
        self.wait()
        self._join_deletion()

    def _complete(self, tmp: Path, final: Path, started: float) -> None:
        barrier()  # every rank's shards, RNG file and the metadata are on disk
        if self.env.is_main:
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(self.root)
            write_text_atomic(self.root / "latest", final.name + "\n")
            self._prune()
        barrier()
        self.last_save = time.monotonic()
        self.save_seconds.append(self.last_save - started)
        log.info("checkpoint %s complete in %.2fs", final.name, self.save_seconds[-1])

    def _prune(self) -> None:
        doomed = []
        for old in complete_checkpoints(self.root)[self.keep :]:
            if old.name == self.protected:
                continue
            # Renamed first, so a deletion cut short can never look like a complete checkpoint.
            doomed.append(old.with_name(f"{CHECKPOINT_TMP_PREFIX}deleting-{old.name}"))
            os.rename(old, doomed[-1])
        if doomed:
            self._join_deletion()  # at most one deletion in flight: disk use stays bounded
            self._deleting = threading.Thread(
                target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed],
                name="checkpoint-prune",
                daemon=True,  # a process killed mid-deletion leaves a .tmp-* that the next start removes
            )
            self._deleting.start()

    def _join_deletion(self) -> None:
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    # ------------------------------------------------------------------ loading

    def newest_step(self) -> int | None:
        """The step of the newest complete checkpoint on disk, as rank 0 sees it (collective)."""
        found = complete_checkpoints_in(self.root) if self.env.is_main else None
        newest = broadcast_object(self.env, found[-1][0] if found else None)
        return newest if isinstance(newest, int) else None

    def load_latest(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]
    ) -> tuple[dict[str, Any], Path] | None:
        """Restore the newest checkpoint that loads on every rank; None if there is none.
        ``optimizer`` may be a list (one optimizer per parameter, optimizer_in_backward): DCP's
        get_state_dict/set_state_dict merge them into one state keyed by parameter name.

        Newer checkpoints that failed are set aside once an older one loads. Raises
        :class:`ResumeFailed` when checkpoints exist (or were set aside earlier) but none
        of them loads."""
        listing = broadcast_object(
            self.env,
            ([str(p) for p in complete_checkpoints(self.root)], [p.name for p in broken_checkpoints_in(self.root)])
            if self.env.is_main
            else None,
        )
        assert isinstance(listing, tuple)
        candidates, earlier_aside = listing
        options = state_dict_options(model)
        failures: list[tuple[Path, list[str]]] = []
        for path_text in candidates:
            path = Path(path_text)
            loaded, error = self._read(path, model, optimizer, options)
            errors = [e for e in all_gather_object(self.env, error) if e]
            if errors:
                if error:
                    log.error("checkpoint %s failed to load on %s", path.name, error)
                if self.env.is_main:
                    log.error("checkpoint %s is unusable; falling back to the previous one", path.name)
                failures.append((path, errors))
                continue
            assert loaded is not None
            state, trainer_state, rng = loaded
            self._restore(path, model, optimizer, options, state, rng)
            if self.env.is_main and failures:
                self._set_aside(failures, loaded=path)
            barrier()
            return trainer_state, path
        if candidates:
            raise ResumeFailed(
                f"none of the {len(candidates)} checkpoint(s) in {self.root} could be loaded "
                f"(newest: {Path(candidates[0]).name}: {failures[0][1][0]}); nothing was renamed"
            )
        if earlier_aside:
            raise ResumeFailed(
                f"{self.root} holds only checkpoints set aside as broken ({', '.join(earlier_aside)}); "
                "rename one back to step-N to resume from it, or delete them to start over"
            )
        return None

    def _read(
        self, path: Path, model: torch.nn.Module, optimizer, options
    ) -> tuple[tuple[dict[str, Any], dict[str, Any], Any] | None, str | None]:
        """This rank's (state dicts, trainer state, RNG state or None) read from ``path``, and None;
        or None and why it could not be read. Everything is read and checked here: :meth:`_restore`
        only puts what passed on every rank into place, and cannot fail on what a file holds.
        The shards first: ``load`` is collective, so every rank enters it whatever its own
        small files hold (a rank that skipped it would leave the others waiting in it)."""
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            state = {"model": model_sd, "optim": optim_sd}
            load(state, path)  # never dcp.load: a planted pickle in the checkpoint would run
            trainer_state = load_trainer_state(path / "trainer_state.json")
            rng = load_rng(path / f"rng-rank{self.env.rank:05d}.pt")
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure: try the previous one
            return None, f"rank {self.env.rank}: {describe_load_error(exc)}"
        return (state, trainer_state, rng), None

    def _restore(self, path: Path, model: torch.nn.Module, optimizer, options, state: dict[str, Any], rng) -> None:
        """Put what :meth:`_read` got from ``path`` into the model, the optimizer and the RNGs."""
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
        if rng is not None:
            set_rng_state(rng)
        else:  # only ranks beyond the checkpoint's world lack one: each says so in its own log
            log.warning(
                "no RNG state for rank %d in %s (the world grew since it was saved): this rank's random "
                "streams (dropout) start from the seed",
                self.env.rank,
                path.name,
            )

    def _set_aside(self, failures: list[tuple[Path, list[str]]], loaded: Path) -> None:
        """Rank 0: rename checkpoints that failed while ``loaded`` (older) loaded."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for path, errors in failures:
            target = path.with_name(f"{CHECKPOINT_BROKEN_PREFIX}{path.name}-{stamp}")
            # The reason goes in first: a rename is the last thing that happens to it.
            write_json_atomic(
                path / "broken.json",
                {
                    "checkpoint": path.name,
                    "errors": errors,
                    "loaded_instead": loaded.name,
                    "set_aside_at": time.time(),
                    "job_id": os.environ.get("SLURM_JOB_ID"),
                    "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                },
            )
            os.rename(path, target)
            log.error("set %s aside as %s: it failed to load while %s loaded", path.name, target.name, loaded.name)
        fsync_dir(self.root)
        write_text_atomic(self.root / "latest", loaded.name + "\n")
