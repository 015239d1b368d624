"""What a container site's steps take into the image (:mod:`jobgen.spec.containers` builds the
words): the host directories the job reads and writes, at their own paths; where a step starts;
the variables a runtime that passes none unnamed (podman) must be given; the GPUs.

The directories are the runs root (run directory, switch files, logs, checkpoints), the data
cache, HF_HOME, the snapshot directory (node-local memory), the model's, the data's and the
evaluation's directories and your own program's, and jobgen's checkout when jobgen runs from one
(it is then on PYTHONPATH, ahead of the image's jobgen). One mount covers whatever lies under it.
"""

from __future__ import annotations

import os
from pathlib import Path

from jobgen.base.owned_dir import OwnedDir, Sharing, UntrustedDirectory
from jobgen.base.paths import CHECKOUT
from jobgen.spec.containers import PODMAN_ENV_FAMILIES, ContainerStep, mount_flags, outermost, step_words
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.site import PythonSettings


def _directory(path: str | None) -> str | None:
    """The directory to mount for a path the spec gives: itself when it is one, else its
    parent; None for what is no local path (a hub id)."""
    if not path or not os.path.isabs(path):
        return None
    return path if os.path.isdir(path) else str(Path(path).parent)


def job_directories(spec: ResolvedSpec) -> list[str]:
    """The host directories a run's steps read or write (see the module's docstring)."""
    run, paths = spec.run, spec.site.paths
    given = [str(spec.runs_root), paths.data_cache, paths.hf_home, paths.snapshot_dir]
    given += [_directory(run.model.path if run.model else None)]
    given += [_directory(path) for _key, path in (run.data.paths() if run.data else [])]
    if run.eval is not None:
        given += [_directory(run.eval.path), _directory(run.eval.prompts_file)]
    if run.command is not None:
        given += [_directory(run.command.script), run.command.workdir]
    return [path for path in given if path and os.path.isabs(path)]


def mounted_directories_made(spec: ResolvedSpec) -> tuple[str, str] | None:
    """A container site's shared directories that the job would create itself, made now: a
    runtime refuses to mount a directory that is not there (podman exits 125 before the program
    starts). The data cache as the trainer makes it (its owner's, 0700, trusted as a group's),
    HF_HOME as any cache. (key, problem) when one cannot be made."""
    paths = spec.site.paths
    if spec.site.python.kind != "container":
        return None
    makers = [
        ("paths.hf_home", paths.hf_home, lambda path: os.makedirs(path, exist_ok=True)),
        ("paths.data_cache", paths.data_cache, lambda path: OwnedDir.ensure(path, sharing=Sharing.GROUP).close()),
    ]
    for key, path, make in makers:
        try:
            if path:
                make(path)
        except (OSError, UntrustedDirectory) as exc:
            return f"site.{key}", f"the container mounts it, and it could not be made: {exc}"
    return None


def container_step(py: PythonSettings, shared: list[str], env_names: list[str], gpus: bool) -> ContainerStep:
    """Every step's container: ``shared`` (and the checkout) mounted at their paths, the step
    started in the first of them, the site's variables named beside the families every runtime
    needs, the node's GPUs when the site has some."""
    # A site's writable mount of a directory at its own path covers what lies under it as well;
    # a read-only one does not (the runs root under it must stay writable).
    own_paths = [
        m.split(":")[0]
        for m in py.container_mounts
        if _same_path(m) and "ro" not in mount_flags(py.container_runtime, m)
    ]
    checkout = [str(CHECKOUT)] if CHECKOUT else []
    directories = [path for path in outermost([*shared, *checkout, *own_paths]) if path not in own_paths]
    # A site's mount over one of jobgen's directories goes first, or it would hide it.
    over = [m for m in py.container_mounts if any(_under(path, m.split(":")[1]) for path in directories)]
    rest = [m for m in py.container_mounts if m not in over]
    names = sorted({*env_names, "PYTHONNOUSERSITE", *(["PYTHONPATH"] if checkout else [])})
    return ContainerStep(
        image=py.container_image or "",
        mounts=(*over, *(f"{path}:{path}" for path in directories), *rest),
        workdir=shared[0],
        env=(*PODMAN_ENV_FAMILIES, *(name for name in names if not _in_family(name))),
        overrides=tuple(names),
        gpus=gpus,
        options=tuple(py.container_options),
    )


def _same_path(mount: str) -> bool:
    return mount.split(":")[0] == mount.split(":")[1]


def _under(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip("/") + "/")


def _in_family(name: str) -> bool:
    return any(name.startswith(family.rstrip("*")) for family in PODMAN_ENV_FAMILIES)


def container_words(py: PythonSettings, shared: list[str], env_names: list[str], gpus: bool) -> list[str]:
    """The words that run a step inside the site's image, or none where the site runs none."""
    if py.kind != "container":
        return []
    return step_words(py.container_runtime, container_step(py, shared, env_names, gpus))
