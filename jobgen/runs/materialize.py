"""A run directory assembled or brought up to date: the one place that writes spec.json, run.toml's
copy and the batch scripts of a run (``jobgen submit``, a sweep's points, ``submit --local``).

A new run directory is assembled under a temporary name in the runs root and renamed into place,
so an error at any point leaves either no directory or a complete one. Resubmitting an existing
run keeps its checkpoints and logs and replaces spec and scripts atomically, one file at a time;
its previous spec goes to history/. A run whose identity ([model], [data], [train]'s seed...: the
keys its checkpoints depend on) changed is refused.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobgen.base.atomic import TargetExists, staged_directory, write_json_atomic, write_text_atomic
from jobgen.base.safe_read import DamagedFile, read_json
from jobgen.runs.permissions import SWITCHES_MODE, repair_modes
from jobgen.runs.rundir import IDENTITY_KEYS, SUBDIRS, RunDir, RunDirError, RunDirTaken

if TYPE_CHECKING:
    from jobgen.spec.resolved import ResolvedSpec


def _identity(spec_json: dict[str, Any]) -> dict[str, Any]:
    return {key: spec_json["run"].get(key) for key in IDENTITY_KEYS}


def materialize(
    spec: ResolvedSpec, script: str, source_text: str | None, *, new_only: bool = False
) -> tuple[RunDir, bool]:
    """Create the run directory, or update an existing one for a continued run, with
    ``script`` (the rendered batch script, jobgen.launch.render.render) as ``<program>.sbatch``.
    ``new_only``: the caller found no run directory and checked nothing about a running
    one, so one that exists now is :class:`RunDirTaken`, as is losing the race to create it.

    Returns the run dir and whether it was newly created.
    """
    run = RunDir(spec.run_dir)
    spec_json = spec.to_json()
    scripts = {run.script(spec.run.job.program).name: script}
    try:
        spec.runs_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create runs root {spec.runs_root}: {exc.strerror}") from None
    if run.path.is_symlink():
        # A teammate who can write the runs root could point your run's name at a directory of
        # theirs (your spec, scripts and checkpoints would go there) or of yours (overwritten).
        raise RunDirError(
            f"{run.path} is a symbolic link: jobgen writes a run only into its own directory and follows no "
            "link at its name; remove the link or choose another job.name"
        )
    if run.path.exists():
        if new_only and run.exists():
            raise RunDirTaken(run.path, spec.run.job.name)
        if not run.exists():
            raise RunDirError(
                f"{run.path} exists but is not a jobgen run directory (no spec.json); "
                "choose another job.name or move it away"
            )
        _update(run, spec_json, scripts, source_text)
        return run, False
    try:
        _create(run, spec_json, scripts, source_text)
    except TargetExists:
        # Another submission's rename won: its directory is whole and is left alone.
        raise RunDirTaken(run.path, spec.run.job.name) from None
    return run, True


def _fill(path: Path, spec_json: dict[str, Any], scripts: dict[str, str], source_text: str | None) -> None:
    write_json_atomic(path / "spec.json", spec_json)
    if source_text is not None:
        write_text_atomic(path / "run.toml", source_text)
    for name, text in scripts.items():
        write_text_atomic(path / name, text, mode=0o777)  # executable, as the umask allows


def _create(run: RunDir, spec_json: dict[str, Any], scripts: dict[str, str], source_text: str | None) -> None:
    with staged_directory(run.path) as staging:
        for sub in SUBDIRS:
            (staging / sub).mkdir()
        os.chmod(staging / "switches", SWITCHES_MODE)
        _fill(staging, spec_json, scripts, source_text)


def _update(run: RunDir, spec_json: dict[str, Any], scripts: dict[str, str], source_text: str | None) -> None:
    old = read_json(run.spec_file)  # its identity only: a spec of an older jobgen is no damage
    if not isinstance(old, dict) or not isinstance(old.get("run"), dict):
        raise DamagedFile(run.spec_file, "not a jobgen spec (an object with the object 'run'); move it away")
    before, after = _identity(old), _identity(spec_json)
    changed = [k for k in IDENTITY_KEYS if before.get(k) != after.get(k)]
    # Before any checkpoint there is nothing the change could misfit: a run that failed on a
    # wrong data path is fixed and submitted again, as jobgen status advises.
    if changed and _holds_checkpoints(run.checkpoints):
        raise RunDirError(
            f"{run.path} holds a run with a different [{'], ['.join(changed)}]; its checkpoints would not fit. "
            "Use a new job.name, or move the old run directory away"
        )
    for sub in SUBDIRS:
        (run.path / sub).mkdir(exist_ok=True)
    repair_modes(run.path, run.switches)
    stamp = dt.datetime.now().strftime("%Y%m%dT%H%M%S%f")
    write_json_atomic(run.path / "history" / f"spec-{stamp}.json", old)
    _fill(run.path, spec_json, scripts, source_text)


def _holds_checkpoints(directory: Path) -> bool:
    """Whether the run's checkpoint directory holds anything but what a save in progress or
    cut short leaves (``.tmp-*``): the trainer's checkpoints, or whatever your own program saved."""
    try:
        return any(not entry.name.startswith(".") for entry in os.scandir(directory))
    except FileNotFoundError:
        return False


def remove_new(run: RunDir) -> None:
    """Undo a run directory this submission created, when the submission itself failed."""
    shutil.rmtree(run.path, ignore_errors=True)
