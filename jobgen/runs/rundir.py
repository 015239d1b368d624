"""The run directory: ``<runs_root>/<job name>/``, everything a later array task or
another user needs, nothing only in memory.

This module owns the layout: every name in a run directory is spelled here, once, and
everything else asks :class:`RunDir` for it (the trainer, the watchdogs, ``jobgen``'s
commands, and the batch script, whose names :mod:`jobgen.launch.render` gets from here).

Layout::

    spec.json        resolved spec (run + site), what the script was rendered from
    run.toml         the file the user submitted, verbatim
    <program>.sbatch the rendered script
    jobs.json        every submission: job id, array, dependency, time
    switches/        kill, save, abort (touch works as well as `jobgen stop`);
                     stop.<job>.<restart>: a stop request from the batch shell's trap
    logs/            <job name>-<job>.out (the batch log), <job name>-<job>-<node>.out,
                     exit-code.<job>.<restart>, task.<job>.<restart>.json (how it ended),
                     command-plan.<job>.<restart>.json (what a command program's task runs),
                     ranks/<job>/<node>/ (torchrun's), ranks/<job>/ranks.<restart>.json
                     (rank map), ranks/<job>/ends.<restart>/ (failed ranks), nccl-*.log,
                     ranks/<job>/heartbeats.<restart>.<launch>/, hung.<job>.<restart>,
                     snapshots-off.<job>.<restart>.json (why no memory snapshots were taken)
    hangs/           every rank's stacks of a hung job (<time>-job<job>.txt)
    checkpoints/     step-<step>/, .tmp-*, broken-* (see trainer.checkpoints.checkpointer)
    repro/<job>/ history/ failed done writer.lock
    quarantine.json  nodes kept off the run's later tasks (jobgen.runs.quarantine)
    tensorboard/ wandb/ wandb-id   experiment tracking (train.report_to)
    serve.json serve-job.json served/ logs/serve/   jobgen serve (the address, the job, the exports)

A new run directory is assembled under a temporary name in the runs root and renamed into place,
so an error at any point leaves either no directory or a complete one. Resubmitting an existing
run keeps its checkpoints and logs and replaces spec and scripts atomically, one file at a time.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobgen.base.atomic import write_json_atomic
from jobgen.base.safe_read import DamagedFile, read_best, read_failure, read_jobs
from jobgen.runs.permissions import SWITCH_FILE_MODE, why_not_writable

if TYPE_CHECKING:  # pydantic only where a spec is read: a sweep's claim uses RunDir with the standard library
    from jobgen.spec.resolved import ResolvedSpec
SUBDIRS = ("switches", "logs", "checkpoints", "repro", "history")
# Switch files under switches/: kill saves and exits, save saves and goes on, abort exits
# without saving. kill and abort also keep a task from starting at all (STARTUP_SWITCHES,
# checked by the batch script and again by the trainer before it loads anything).
KILL_SWITCH, SAVE_SWITCH, ABORT_SWITCH = "kill", "save", "abort"
SWITCHES = (KILL_SWITCH, SAVE_SWITCH, ABORT_SWITCH)
STARTUP_SWITCHES = (KILL_SWITCH, ABORT_SWITCH)
# The modes of switches/ and of a switch file (SWITCHES_MODE, SWITCH_FILE_MODE), and why: jobgen.runs.permissions.
# Checkpoint directories under checkpoints/: only a rename ever gives a directory its
# final name, so a name is a promise about the content.
CHECKPOINT_PREFIX = "step-"  # complete: step-00000120
CHECKPOINT_TMP_PREFIX = ".tmp-"  # a save in progress, or one cut short
CHECKPOINT_BROKEN_PREFIX = "broken-"  # failed to load while an older one loaded: set aside for a person
# Keys whose change would make the checkpoints in an existing run meaningless.
IDENTITY_KEYS = ("model", "data")


def switch_is_set(path: Path) -> bool:
    """Whether a switch (or a stop request) is set: a regular file at its name, as ``touch`` or
    jobgen leaves it. A symbolic link, dangling or not, is not a switch. The one rule for
    ``jobgen stop``, the trainer and the batch script (whose test is ``-f X && ! -L X``)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def checkpoint_name(step: int) -> str:
    """The directory name of the complete checkpoint of ``step``."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a complete checkpoint's directory name (``step-00000120`` → 120); None
    for any other name (a save in progress, one set aside, ``latest``)."""
    suffix = name[len(CHECKPOINT_PREFIX) :]
    return int(suffix) if name.startswith(CHECKPOINT_PREFIX) and suffix.isdecimal() else None


def complete_checkpoints_in(directory: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under ``directory``, oldest first. Never a
    link: only a rename makes a checkpoint, and a link may lead to another run's."""
    found = ((checkpoint_step(p.name), p) for p in directory.glob(f"{CHECKPOINT_PREFIX}*"))
    return sorted((step, p) for step, p in found if step is not None and p.is_dir() and not p.is_symlink())


def broken_checkpoints_in(directory: Path) -> list[Path]:
    """Checkpoints under ``directory`` that were set aside because they failed to load."""
    return sorted(p for p in directory.glob(f"{CHECKPOINT_BROKEN_PREFIX}*") if p.is_dir())


class RunDirError(RuntimeError):
    """A run directory that cannot be created or continued; the message says why."""


class RunDirTaken(RunDirError):
    """Another submission of the same run created its directory while this one was
    creating it, or after this one had found none (and so skipped the busy-run checks)."""

    def __init__(self, path: Path, name: str):
        super().__init__(
            f"run {path} was created by another submission of {name} at the same moment: "
            f"see what it started (jobgen status {name}), or stop it first (jobgen stop {name})"
        )


# Specs read by this process (RunDir.load_spec), by file, with the stat they were read at.
_SPECS: dict[Path, tuple[tuple[int, int, int, int], ResolvedSpec]] = {}
_SPECS_KEPT = 4096


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def spec_file(self) -> Path:
        return self.path / "spec.json"

    @property
    def jobs_file(self) -> Path:
        return self.path / "jobs.json"

    @property
    def switches(self) -> Path:
        return self.path / "switches"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def metrics(self) -> Path:
        """A line per logging step and per evaluation (jobgen.runs.jsonl_records); its summary,
        ``metrics.summary.json``, is a cache beside it (jobgen.runs.summary_cache)."""
        return self.path / "metrics.jsonl"

    @property
    def task_lines(self) -> Path:
        """Each task's first step and exit, from the trainer or a program (jobgen.runs.jsonl_records)."""
        return self.path / "tasks.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def done_marker(self) -> Path:
        """Written when the run reached max_steps: later array tasks exit at once."""
        return self.path / "done"

    @property
    def failed_marker(self) -> Path:
        """Written when the run failed in a way every later task would repeat (JSON: exit
        code, reason, what to change); the batch script checks it first. ``jobgen submit``
        moves it into history/."""
        return self.path / "failed"

    def mark_failed(self, code: int, reason: str, fix: str, job_id: str | None, restart: int) -> Path:
        """The failed marker, its one writer (the trainer's rank 0 and the job's supervisor):
        what failed, what to change, and by which attempt; no task starts again until
        ``jobgen submit`` moves it into history/."""
        marker = {"exit_code": int(code), "reason": reason, "fix": fix, "job_id": job_id, "restart": restart}
        write_json_atomic(self.failed_marker, {**marker, "time": time.time()})
        return self.failed_marker

    @property
    def best_checkpoint(self) -> Path:
        """``checkpoints/best.json``: the checkpoint with the lowest eval loss ([eval]), agreed by
        all ranks and written atomically; never pruned by keep_checkpoints."""
        return self.checkpoints / "best.json"

    @property
    def samples(self) -> Path:
        """``samples.jsonl``: the generations of ``[eval] prompts``, a line per prompt per evaluation."""
        return self.path / "samples.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files (train.report_to), one file per job."""
        return self.path / "tensorboard"

    @property
    def wandb_dir(self) -> Path:
        return self.path / "wandb"

    @property
    def wandb_id(self) -> Path:
        """The W&B run id every job of this run resumes (train.report_to)."""
        return self.path / "wandb-id"

    @property
    def quarantine(self) -> Path:
        """Nodes a task of this run found at fault, kept off its later tasks (jobgen.runs.quarantine)."""
        return self.path / "quarantine.json"

    @property
    def writer_lease(self) -> Path:
        """flock'ed by the one process that trains this run (jobgen.base.lease)."""
        return self.path / "writer.lock"

    # `jobgen serve` (jobgen.serve.submit). A model directory served as it is (`jobgen serve DIR`)
    # gets the same names under it.
    @property
    def served(self) -> Path:
        """``served/<checkpoint>/``: the checkpoints exported for serving; each appears by rename, complete."""
        return self.path / "served"

    @property
    def serve_address(self) -> Path:
        """``serve.json``: where the server answers (host, port, model, engine, job), written atomically by
        the serve job as soon as the server answers; removed when it stops."""
        return self.path / "serve.json"

    @property
    def serve_job(self) -> Path:
        """``serve-job.json``: the serve job `jobgen serve` started last (job id, model, checkpoint)."""
        return self.path / "serve-job.json"

    def serve_log(self, job_id: str | int) -> Path:
        """The serve job's output: its batch script, the supervisor and the server."""
        return self.logs / "serve" / f"{job_id}.out"

    def best(self) -> dict[str, Any] | None:
        """``best.json`` (step, checkpoint, eval_loss, time), or None without a readable one
        (the trainer writes it again; jobgen.base.safe_read.read_best says what is wrong with it)."""
        try:
            return read_best(self.best_checkpoint)
        except DamagedFile:
            return None

    def checkpoint_for(self, *, best: bool = False, step: int | None = None) -> str | None:
        """The checkpoint ``--best`` or ``--step N`` selects, by name; None for neither (the
        newest that loads). Raises RunDirError naming what is missing."""
        if best and step is not None:
            raise RunDirError("choose --best or --step, not both")
        if step is not None:
            name = checkpoint_name(step)
            if not (self.checkpoints / name).is_dir():
                have = ", ".join(str(s) for s, _ in self.complete_checkpoints()) or "none"
                raise RunDirError(f"{self.checkpoints} has no checkpoint of step {step} (complete ones: {have})")
            return name
        if not best:
            return None
        chosen = self.best()
        if chosen is None or not isinstance(chosen.get("checkpoint"), str):
            raise RunDirError(
                f"{self.best_checkpoint} is missing or unreadable: the run has no [eval], or no evaluation has "
                "finished yet"
            )
        name = chosen["checkpoint"]
        if checkpoint_step(name) is None or not (self.checkpoints / name).is_dir():
            raise RunDirError(
                f"{self.best_checkpoint} names {name}, which is not a complete checkpoint of {self.checkpoints} "
                "(set aside as broken?); the trainer names the best one again at its next start"
            )
        return name

    def broken_checkpoints(self) -> list[Path]:
        return broken_checkpoints_in(self.checkpoints)

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete checkpoint, oldest first."""
        return complete_checkpoints_in(self.checkpoints)

    def failure(self) -> dict[str, Any] | None:
        """What the ``failed`` marker says (exit_code, reason, fix, job_id, ...), or None when
        the run is not stopped by a repeating failure. An unreadable marker still stops the
        run, and says so."""
        return read_failure(self.failed_marker)

    # Names that hold a job id, a restart count or a node take them as text, so that the
    # batch script can be given the same names with shell expressions ("$SLURM_JOB_ID")
    # or Slurm filename patterns ("%j") in their place (jobgen.launch.render).

    def switch(self, name: str) -> Path:
        if name not in SWITCHES:
            raise ValueError(f"unknown switch {name!r}; one of {SWITCHES}")
        return self.switches / name

    def stop_request_stem(self, job_id: str | int) -> Path:
        """``stop.<job>``: each attempt's stop request adds ``.<restart>`` to it (and jobgen
        before restart counts wrote the stem itself), so ``<stem>`` and ``<stem>.*`` are
        every request any attempt of the job can have left."""
        return self.switches / f"stop.{job_id}"

    def stop_request(self, job_id: str | int, restart: str | int) -> Path:
        """What the batch shell's signal trap leaves for the trainer of this attempt of a job.
        A requeued job keeps its id, so the restart count is part of the name: a request an
        earlier attempt never consumed can never stop a later one."""
        stem = self.stop_request_stem(job_id)
        return stem.with_name(f"{stem.name}.{restart}")

    def stop_requests(self) -> list[tuple[Path, str, int | None]]:
        """Every stop request in switches/: (path, job id, restart; None for the bare stem)."""
        named = ((p, *p.name.removeprefix("stop.").partition(".")[::2]) for p in sorted(self.switches.glob("stop.*")))
        return [(p, job, int(r) if r else None) for p, job, r in named if job and (not r or r.isdecimal())]

    def exit_code_file(self, job_id: str | int, restart: str | int) -> Path:
        """Just the trainer's exit code, for the batch script to exit with (one per attempt)."""
        return self.logs / f"exit-code.{job_id}.{restart}"

    def task_record(self, job_id: str | int, restart: str | int) -> Path:
        """The batch script's own record of how one attempt of a job ended (JSON: ids, nodes,
        start, end, exit code, what Slurm was told, the reason), written as it exits, so
        ``jobgen status`` shows every task after Slurm has forgotten it."""
        return self.logs / f"task.{job_id}.{restart}.json"

    def task_records(self) -> list[Path]:
        return sorted(self.logs.glob("task.*.json"))

    def snapshots_off(self, job_id: str | int, restart: str | int) -> Path:
        """Why the trainer took no memory snapshots in one attempt (train.snapshot_every_steps;
        JSON: the node, the directory refused, its owner, the reason), for ``jobgen status``;
        the next attempt that takes them removes it (trainer.checkpoints.snapshots)."""
        return self.logs / f"snapshots-off.{job_id}.{restart}.json"

    def snapshots_off_records(self) -> list[Path]:
        return sorted(self.logs.glob("snapshots-off.*.json"))

    def command_plan(self, job_id: str | int, restart: str | int) -> Path:
        """What one attempt of a ``program = "command"`` job runs on every rank (argv, env, the
        checkpoint it resumes from): decided once on the head node (jobgen.launch.command_plan)."""
        return self.logs / f"command-plan.{job_id}.{restart}.json"

    def batch_log(self, job_name: str, job_id: str | int) -> Path:
        """The batch script's output (sbatch --output; ``jobgen submit --local`` writes the
        same file). Slurm's job name is the run directory's name."""
        return self.logs / f"{job_name}-{job_id}.out"

    def node_log(self, job_name: str, job_id: str | int, node: str) -> Path:
        """One node's output of the launch step, for sites that ask for it (srun --output)."""
        return self.logs / f"{job_name}-{job_id}-{node}.out"

    def rank_logs(self, job_id: str | int, node: str) -> Path:
        """torchrun's --log-dir on one node: its per-rank stdout and stderr below."""
        return self.logs / "ranks" / str(job_id) / node

    def rank_identity(self, job_id: str | int, node: str, restart: str | int, local_rank: str | int) -> Path:
        """A rank's own word on its global rank (JSON: rank, group_rank), next to its node's logs."""
        return self.rank_logs(job_id, node) / f"rank.{restart}.{local_rank}.json"

    def rank_map(self, job_id: str | int, restart: str | int) -> Path:
        """Which node and local rank each global rank of one attempt ran as (the trainer's
        rank 0 writes it at start), for ``jobgen logs --rank``."""
        return self.logs / "ranks" / str(job_id) / f"ranks.{restart}.json"

    def rank_maps(self, job_id: str | int) -> list[Path]:
        return sorted((self.logs / "ranks" / str(job_id)).glob("ranks.*.json"))

    def rank_end(self, job_id: str | int, restart: str | int, rank: int, launch: int = 0) -> Path:
        """What one rank of one attempt left as it failed (jobgen.runs.quarantine.RankEnd); a
        relaunch inside the attempt (job.in_job_restarts) keeps its own."""
        return self._rank_ends_dir(job_id, restart, launch) / f"rank{rank}.json"

    def rank_ends(self, job_id: str | int, restart: str | int, launch: int = 0) -> list[Path]:
        return sorted(self._rank_ends_dir(job_id, restart, launch).glob("rank*.json"))

    def _rank_ends_dir(self, job_id: str | int, restart: str | int, launch: int) -> Path:
        return self.logs / "ranks" / str(job_id) / (f"ends.{restart}.{launch}" if launch else f"ends.{restart}")

    def heartbeats(self, job_id: str | int, restart: str | int, launch: str | int) -> Path:
        """Where each rank of one launch keeps its heartbeat (jobgen.runs.heartbeat), which
        the job's supervisor watches for a hang (train.hang_timeout)."""
        return self.logs / "ranks" / str(job_id) / f"heartbeats.{restart}.{launch}"

    @property
    def hangs(self) -> Path:
        """Stack dumps of hung jobs: the batch script's (train.hang_timeout) and the hang watchdog's."""
        return self.path / "hangs"

    def hang_stacks(self, stamp: str, job_id: str | int) -> Path:
        """Every rank's stacks when job ``job_id`` was found hung at ``stamp`` (%Y%m%dT%H%M%S)."""
        return self.hangs / f"{stamp}-job{job_id}.txt"

    def nccl_debug_log(self, job_id: str | int, host: str, pid: str) -> Path:
        """NCCL_DEBUG_FILE of one process, when the site's network.debug is on."""
        return self.logs / f"nccl-{job_id}-{host}-{pid}.log"

    def repro(self, job_id: str | int) -> Path:
        """What the batch script records of one job's environment (jobgen.launch.repro)."""
        return self.path / "repro" / str(job_id)

    def exists(self) -> bool:
        return self.spec_file.is_file()

    def load_spec(self) -> ResolvedSpec:
        """spec.json (jobgen.spec.spec_json.read_spec: DamagedFile naming the file and key),
        validated once per process while the file stays as it was (its inode, size and
        modification time): a listing reads each run's spec several times, a thousand runs' of it."""
        from jobgen.spec.spec_json import read_spec  # (pydantic: see TYPE_CHECKING above)

        try:
            st = os.stat(self.spec_file, follow_symlinks=False)
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        kept = _SPECS.get(self.spec_file)
        if key is not None and kept is not None and kept[0] == key:
            return kept[1]
        spec = read_spec(self.spec_file)
        if key is not None:
            if len(_SPECS) >= _SPECS_KEPT:
                _SPECS.clear()
            _SPECS[self.spec_file] = (key, spec)
        return spec

    def script(self, program: str) -> Path:
        return self.path / f"{program}.sbatch"

    def jobs(self) -> list[dict[str, Any]]:
        """jobs.json (jobgen.base.safe_read.read_jobs: DamagedFile naming the file and entry)."""
        return read_jobs(self.jobs_file)

    def record_job(self, entry: dict[str, Any]) -> None:
        entry = {"submitted_at": _now(), **entry}
        write_json_atomic(self.jobs_file, [*self.jobs(), entry])

    def set_switch(self, name: str) -> tuple[Path, bool]:
        """Set a switch as `touch` would: a file already there, whoever made it, is the
        same request, so it is left alone (a teammate may not write into the owner's file).
        Returns the path and whether this call created it. Anything else at the switch's name
        (a symbolic link, dangling or not) is not a switch: it is removed, or the call fails
        saying so, never reported as "already set" while the run would not see it."""
        target = self.switch(name)
        if self.switches.is_symlink():  # it would lead into another directory, another run's maybe
            raise RunDirError(f"cannot set the {name} switch: {self.switches} is a symbolic link (jobgen makes none)")
        if switch_is_set(target):
            return target, False
        try:
            if os.path.lexists(target):
                os.unlink(target)  # a link is no switch (switch_is_set); O_EXCL below never follows one
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, SWITCH_FILE_MODE)
        except FileExistsError:  # someone set it between the look and the create: the same request
            return target, False
        except OSError as exc:
            what = "replace the link at" if os.path.islink(target) else "set"
            raise RunDirError(f"cannot {what} the {name} switch: {why_not_writable(self.switches, exc)}") from None
        try:
            os.fchmod(fd, SWITCH_FILE_MODE)  # the umask took group-write off; the team needs it
            os.write(fd, f"{_now()} by uid {os.getuid()}\n".encode())
        finally:
            os.close(fd)
        return target, True


def startup_switch_set(run: RunDir) -> str | None:
    """The startup switch set on ``run`` (kill or abort: a regular file, not a link), or None."""
    return next((name for name in STARTUP_SWITCHES if switch_is_set(run.switch(name))), None)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def default_runs_root() -> Path | None:
    """Where run names are looked up: $JOBGEN_RUNS_ROOT, else the runs root of the site
    profile $JOBGEN_SITE (default 'local')."""
    if os.environ.get("JOBGEN_RUNS_ROOT"):
        return Path(os.environ["JOBGEN_RUNS_ROOT"]).expanduser()
    from jobgen.spec.loader import SpecError, find_site_file, read_toml

    try:
        site = read_toml(find_site_file(os.environ.get("JOBGEN_SITE", "local"), Path.cwd()))
    except SpecError:
        return None
    root = site.get("paths", {}).get("runs_root")
    return Path(os.path.expanduser(root)) if root else None


def find_run(ref: str, runs_root: Path | None) -> RunDir:
    """A run given as its directory, or as its name under ``runs_root``."""
    as_path = Path(ref).expanduser()  # a spec.json that is no file: its reader says so (DamagedFile)
    if os.path.lexists(as_path / "spec.json"):
        return RunDir(as_path.absolute())
    if runs_root is not None and "/" not in ref and os.path.lexists(runs_root / ref / "spec.json"):
        return RunDir(runs_root / ref)
    where = f" or under {runs_root}" if runs_root else ""
    raise RunDirError(f"no run '{ref}': not a run directory{where} (a run directory holds spec.json)")
