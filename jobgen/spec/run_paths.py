"""The paths a run.toml names, before and after validation: on the raw document, each local
path that does not exist named by its key (so these errors come even when other keys of the
same table are invalid); in the validated run, local paths made absolute against run.toml's
directory (compute nodes do not share the submitter's cwd); where the site's jobs may not
download, a data path that is no file is a hub id only if the hub cache holds it.

Each check returns (key, message) pairs; jobgen.spec.loader words them as its issues.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jobgen.spec.data_files import hub_caches, looks_like_hub_id, offline_hub_problem
from jobgen.spec.tables.run import RunSpec
from jobgen.spec.tables.site import SiteProfile


def absolute_path(value: str, base: Path) -> str:
    """``~`` expanded, relative paths joined to ``base``, no symlinks resolved (a shared
    filesystem may be mounted through one on purpose)."""
    path = Path(os.path.expanduser(value))
    return os.path.normpath(path if path.is_absolute() else base / path)


def _local_path(value: str, base_dir: Path) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else base_dir / path


def _raw_key(raw: dict[str, Any], table: str, key: str) -> object:
    section = raw.get(table)
    return section.get(key) if isinstance(section, dict) else None


def _raw_source_paths(raw: dict[str, Any]) -> list[tuple[str, object]]:
    """(key, value) of data.path and of every data.sources[i].path in the raw document."""
    found = [("data.path", _raw_key(raw, "data", "path"))]
    sources = _raw_key(raw, "data", "sources")
    for i, source in enumerate(sources if isinstance(sources, list) else []):
        found.append((f"data.sources[{i}].path", source.get("path") if isinstance(source, dict) else None))
    return found


def missing_paths(raw: dict[str, Any], base_dir: Path) -> list[tuple[str, str]]:
    """model.path and data.path must exist, unless they are hub ids ('org/name').
    Checked on the raw document so these errors are reported even when other keys
    of the same tables are invalid."""
    issues = []
    for key, value in [("model.path", _raw_key(raw, "model", "path")), *_raw_source_paths(raw)]:
        if not isinstance(value, str):
            continue
        local = _local_path(value, base_dir)
        if not local.exists() and not looks_like_hub_id(value, data=key != "model.path", bare_name=False):
            issues.append((key, f"'{value}' does not exist (resolved to {local})"))
    section = raw.get("eval")
    for key in ("path", "prompts_file"):
        value = section.get(key) if isinstance(section, dict) else None
        local = _local_path(value, base_dir) if isinstance(value, str) else None
        hub = key == "path" and local is not None and looks_like_hub_id(value, data=True, bare_name=False)
        if local is not None and not local.exists() and not hub:
            issues.append((f"eval.{key}", f"'{value}' does not exist (resolved to {local})"))
    command = raw.get("command")
    for key, kind in (("script", "file"), ("workdir", "directory")):
        value = command.get(key) if isinstance(command, dict) else None
        if not isinstance(value, str):
            continue
        local = _local_path(value, base_dir)
        if not (local.is_file() if kind == "file" else local.is_dir()):
            issues.append((f"command.{key}", f"'{value}' is no {kind} (resolved to {local})"))
    return issues


def absolute_paths(run: RunSpec, base_dir: Path) -> RunSpec:
    """Local paths made absolute: compute nodes do not share the submitter's cwd."""
    updates: dict[str, Any] = {}
    for table in ("model", "data"):
        section = getattr(run, table)
        path = section.path if section is not None else None
        local = _local_path(path, base_dir) if path is not None else None
        if local is not None and local.exists():
            updates[table] = section.model_copy(update={"path": str(local.resolve())})
    if run.data is not None and run.data.sources is not None:
        sources = []
        for source in run.data.sources:
            local = _local_path(source.path, base_dir)
            sources.append(source.model_copy(update={"path": str(local.resolve())}) if local.exists() else source)
        updates["data"] = run.data.model_copy(update={"sources": sources})
    if run.eval is not None:
        files = {}
        for key in ("path", "prompts_file"):
            value = getattr(run.eval, key)
            local = _local_path(value, base_dir) if value else None
            if local is not None and local.exists():
                files[key] = str(local.resolve())
        updates["eval"] = run.eval.model_copy(update=files)
    if run.job.runs_root:
        updates["job"] = run.job.model_copy(update={"runs_root": absolute_path(run.job.runs_root, base_dir)})
    if run.command is not None:
        # The program starts in run.toml's directory unless told otherwise: a module of the
        # project that holds run.toml is found from there (torchrun -m puts the cwd on sys.path).
        command = {"workdir": absolute_path(run.command.workdir or ".", base_dir)}
        if run.command.script:
            command["script"] = absolute_path(run.command.script, base_dir)
        updates["command"] = run.command.model_copy(update=command)
    return run.model_copy(update=updates) if updates else run


def offline_hub_ids(raw: dict[str, Any], base_dir: Path, site: SiteProfile) -> list[tuple[str, str]]:
    """Where the site's jobs may not download (HF_HUB_OFFLINE), a data path that is not on disk
    is a hub id only if the cache holds it (jobgen.spec.data_files.offline_hub_problem)."""
    if site.env.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on"):
        return []
    caches = hub_caches(site.paths.hf_home, dict(os.environ))
    issues = []
    for key, value in [*_raw_source_paths(raw), ("eval.path", _raw_key(raw, "eval", "path"))]:
        problem = offline_hub_problem(value, base_dir, caches) if isinstance(value, str) else None
        if problem:
            issues.append((key, problem))
    return issues
