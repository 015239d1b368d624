"""The container runtimes that run a job's steps inside the site's image (``[python] kind =
"container"``): one entry per runtime in :data:`RUNTIMES`, each saying how a step starts in the
image and what it cannot honour.

Every step jobgen starts on the nodes with srun (the launch and its torchrun, the start probe,
the run's records, the head node's address, the hang watch's stacks) is ``srun <options>
<words> <command>``, where ``<words>`` is what :func:`step_words` builds:

- **pyxis** (NVIDIA's SPANK plugin for enroot): srun options; the plugin starts the container
  around the task. The job's environment reaches it, but a variable the image sets keeps the
  image's value unless named in ``--container-env``: the step names the ones jobgen and the site
  set (PYTHONPATH, PYTHONNOUSERSITE, the site's and the run's [env]).
- **apptainer**: ``apptainer exec --bind ... --pwd ... IMAGE`` before the command. The host's
  environment reaches it, except PATH, HOME and LD_LIBRARY_PATH, which are the image's.
- **podman**: ``podman run --rm --network=host --ipc=host --pid=host ... IMAGE`` before the
  command. No variable reaches a podman container unless named, so the step names the families
  jobgen, Slurm, torch, NCCL and Hugging Face read, and the site's own [env] names. The host's
  pid namespace keeps the ranks' pids those of the node: the supervisor's and the hang watch's
  view of the ranks is the same as without a container, and the step is tethered to the
  ``podman run`` that srun started (``JOBGEN_TETHER_PID``, :mod:`jobgen.runtime.tether`): podman's
  conmon leaves Slurm's process tree, so a step Slurm SIGKILLs would otherwise train on.

The batch script itself and the supervisor (``python -m jobgen.job``) stay on the batch host,
outside the image: they call srun, scontrol and squeue, which images do not hold (pyxis#129).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

RuntimeName = Literal["pyxis", "apptainer", "podman"]


@dataclass(frozen=True)
class ContainerStep:
    """What every step of one job needs from its container: the image, the host directories at
    their own paths (``src:dst[:flags]``), where the step starts, the host variables it must see
    (a name, or a prefix ending in ``*``), whether the node's GPUs go in, and the site's own options."""

    image: str
    mounts: tuple[str, ...]
    workdir: str
    env: tuple[str, ...] = ()
    # The variables jobgen and the site set by name, whose values must win over an image's own.
    overrides: tuple[str, ...] = ()
    gpus: bool = False
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Runtime:
    """One container runtime: how a step's words are built, which mount flags it knows, and what
    in an image reference belongs to another runtime."""

    name: RuntimeName
    docs: str  # the documentation, and its version, that the options are written from
    words: Callable[[ContainerStep], list[str]]
    mount_flags: frozenset[str]
    flag_separator: str | None = None  # between one mount's flags; None: a mount has one flag
    foreign_images: tuple[tuple[Callable[[str], bool], str], ...] = field(default=())
    names_environment: bool = False  # True: host variables reach a step only when named
    srun_plugin: bool = False  # its words are srun's options (a SPANK plugin's), not a command


# The variables every podman step takes from the host: what Slurm sets for the step, what the batch
# script and torchrun export for jobgen and torch, what NCCL, gloo, CUDA and the libraries read.
PODMAN_ENV_FAMILIES = (
    "SLURM*",
    "JOBGEN_*",
    "TORCH*",
    "PYTORCH_*",
    "NCCL_*",
    "GLOO_*",
    "CUDA_*",
    "NVIDIA_*",
    "FI_*",
    "UCX_*",
    "OMP_*",
    "MKL_*",
    "HF_*",
    "TRANSFORMERS_*",
    "TOKENIZERS_*",
    "WANDB_*",
    # Set by the batch script for every container step: ~/.local's packages (the home is mounted
    # under pyxis and apptainer) must not shadow the image's.
    "PYTHONNOUSERSITE",
)
# The tether's variable: the pid of the `podman run` that srun started (the step's own shell
# execs it, so its $$ is that pid).
TETHER_ENV = "JOBGEN_TETHER_PID"


def _pyxis_words(step: ContainerStep) -> list[str]:
    return [
        f"--container-image={step.image}",
        f"--container-mounts={','.join(step.mounts)}",
        f"--container-workdir={step.workdir}",
        # Names only: pyxis takes their values from the job, over the image's own.
        *([f"--container-env={','.join(step.overrides)}"] if step.overrides else []),
        *step.options,
    ]


def _apptainer_words(step: ContainerStep) -> list[str]:
    return [
        "apptainer",
        "exec",
        f"--bind={','.join(step.mounts)}",
        f"--pwd={step.workdir}",
        *(["--nv"] if step.gpus else []),
        *step.options,
        step.image,
    ]


def _podman_words(step: ContainerStep) -> list[str]:
    return [
        # A shell that execs podman: its $$ is the pid of the `podman run` srun waits for.
        "bash",
        "-c",
        f'exec podman run --env={TETHER_ENV}="$$" "$@"',
        "podman-step",
        "--rm",
        "--network=host",
        "--ipc=host",
        "--pid=host",
        # The node's host name (c10d, the logs and NCCL's %h name the node, not the container).
        "--uts=host",
        # py-spy (the hang watch's stacks) attaches to the ranks from a step of its own.
        "--cap-add=SYS_PTRACE",
        # Bind mounts readable on SELinux hosts without relabelling the shared filesystem.
        "--security-opt=label=disable",
        # The container's output straight to srun's, not through conmon's log files.
        "--log-driver=passthrough",
        *(f"--env={name}" for name in step.env),
        *(f"--volume={mount}" for mount in step.mounts),
        f"--workdir={step.workdir}",
        *(["--device=nvidia.com/gpu=all"] if step.gpus else []),
        *step.options,
        step.image,
    ]


def _pyxis_syntax(image: str) -> bool:
    return "#" in image


def _registry_without_hash(image: str) -> bool:
    """'registry.example.org/team/image:tag' written for pyxis: enroot reads a registry only
    before '#', so it would pull 'registry.example.org/team/image' from Docker Hub. The first
    part of a path is a registry when it holds a '.' or a ':' or is localhost (docker's rule)."""
    if "#" in image or "://" in image or image.startswith(("/", ".")):
        return False
    first, slash, _ = image.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def _not_apptainers(image: str) -> bool:
    """Neither an absolute path (a .sif, a sandbox directory) nor a URI apptainer pulls from: a
    relative path would be read from each step's working directory, a bare name is no image."""
    return not image.startswith("/") and not image.startswith(APPTAINER_TRANSPORTS) and "#" not in image


# The sources `apptainer exec` reads an image from, besides a file (Apptainer 1.3's user guide).
APPTAINER_TRANSPORTS = (
    "docker://",
    "docker-daemon://",
    "docker-archive://",
    "oci://",
    "oci-archive://",
    "oras://",
    "library://",
    "shub://",
    "http://",
    "https://",
)


def _uri(image: str) -> bool:
    return "://" in image


def _sif(image: str) -> bool:
    return image.endswith(".sif")


RUNTIMES: dict[str, Runtime] = {
    "pyxis": Runtime(
        name="pyxis",
        docs="pyxis 0.20 README (srun --container-*)",
        words=_pyxis_words,
        mount_flags=frozenset({"ro", "rw", "private", "rprivate", "slave", "rslave", "x-create=dir", "x-create=file"}),
        flag_separator="+",  # its mounts are joined with ','
        srun_plugin=True,
        foreign_images=(
            (_uri, "a URI ('docker://...') is apptainer's; pyxis takes 'registry#image:tag' or a squashfs file"),
            (_sif, "a .sif file is apptainer's; pyxis takes 'registry#image:tag' or a squashfs file"),
            (
                _registry_without_hash,
                "pyxis reads a registry only before '#' ('registry.example.org#team/image:tag'); "
                "without it, the image is pulled from Docker Hub",
            ),
        ),
    ),
    "apptainer": Runtime(
        name="apptainer",
        docs="Apptainer 1.3 user guide (apptainer exec)",
        words=_apptainer_words,
        mount_flags=frozenset({"ro", "rw"}),
        foreign_images=(
            (
                _pyxis_syntax,
                "'registry#image' is pyxis's syntax; apptainer takes a .sif file or 'docker://registry/image'",
            ),
            (
                _not_apptainers,
                "apptainer takes an absolute path (a .sif file on the shared filesystem) or a URI "
                "('docker://registry/image:tag', 'oras://...', 'library://...')",
            ),
        ),
    ),
    "podman": Runtime(
        name="podman",
        docs="podman 4.3 podman-run(1)",
        words=_podman_words,
        mount_flags=frozenset({"ro", "rw", "z", "Z", "shared", "slave", "private", "rshared", "rslave", "rprivate"}),
        foreign_images=(
            (_pyxis_syntax, "'registry#image' is pyxis's syntax; podman takes 'registry/image:tag'"),
            (_sif, "a .sif file is apptainer's; podman takes 'registry/image:tag'"),
        ),
        names_environment=True,
    ),
}


def image_problem(runtime: str, image: str) -> str | None:
    """Why ``runtime`` cannot start ``image`` as written (another runtime's syntax), or None."""
    for applies, why in RUNTIMES[runtime].foreign_images:
        if applies(image):
            return f"{image!r}: {why}"
    return None


def mount_flags(runtime: str, mount: str) -> list[str]:
    """The flags of ``mount`` ('src:dst[:flags]') as ``runtime`` separates them."""
    parts = mount.split(":")
    if len(parts) < 3:
        return []
    sep = RUNTIMES[runtime].flag_separator
    return parts[2].split(sep) if sep else [parts[2]]


def mount_problem(runtime: str, mount: str) -> str | None:
    """Why ``runtime`` cannot honour ``mount`` ('src:dst[:flags]'), or None."""
    parts = mount.split(":")
    if len(parts) < 2 or len(parts) > 3 or not all(parts[:2]):
        return f"{mount!r} is not 'src:dst' or 'src:dst:flags'"
    if not (parts[0].startswith("/") and parts[1].startswith("/")):
        return f"{mount!r}: both paths must be absolute"
    known = RUNTIMES[runtime].mount_flags
    flags = mount_flags(runtime, mount)
    unknown = [flag for flag in flags if flag not in known]
    if unknown:
        return f"{mount!r}: {runtime} knows no mount flag {unknown[0]!r} (it knows {', '.join(sorted(known))})"
    return None


# pyxis's options, as srun lists them: every one starts so.
PYXIS_OPTION_PREFIXES = ("--container-", "--no-container-")


def option_problem(runtime: str, option: str) -> str | None:
    """Why ``option`` (a site's container_options word) belongs to another runtime, or None."""
    pyxis_option = option.startswith(PYXIS_OPTION_PREFIXES)
    if RUNTIMES[runtime].srun_plugin and not pyxis_option:
        return f"{option!r} is not a pyxis option (srun --container-* or --no-container-*)"
    if not RUNTIMES[runtime].srun_plugin and pyxis_option:
        return f"{option!r} is pyxis's srun option, not {runtime}'s"
    return None


def outermost(paths: list[str]) -> list[str]:
    """The directories of ``paths`` that lie under none of the others, each once, in the order
    given (never sorted: the checkout's own path must not move the others, or a render would
    depend on where jobgen was cloned): one mount covers what lies beneath it."""
    normal = list(dict.fromkeys(p.rstrip("/") or "/" for p in paths))

    def covered(path: str) -> bool:
        return any(path != other and path.startswith(other.rstrip("/") + "/") for other in normal)

    return [path for path in normal if not covered(path)]


def step_words(runtime: str, step: ContainerStep) -> list[str]:
    """The words that run a step's command inside the image (see the module's docstring)."""
    entry = RUNTIMES[runtime]
    # Only a runtime that passes no variable unnamed is given the names.
    return entry.words(step if entry.names_environment else replace(step, env=()))
