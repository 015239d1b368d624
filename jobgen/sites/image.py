"""A site's image for ``[python] kind = "container"``: jobgen and the trainer's packages built on
top of the site's base image with the bundled Containerfile (jobgen/bundled/container/).

    jobgen image build --base nvcr.io/nvidia/pytorch:25.01-py3 --tag registry.example.org/team/jobgen:0.1.0

The build context is a fresh directory holding the Containerfile and ``wheels/``: jobgen's wheel
(built from the checkout jobgen runs from, or the one given) and any other wheels given, which
the build mounts (never copies into a layer) and pip prefers. The tool is podman, or docker
(BuildKit, for the build's bind mount). apptainer sites convert the result:
``apptainer build jobgen.sif docker-daemon://TAG`` (or ``oci-archive://`` from ``podman save``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from jobgen.base.paths import CHECKOUT, CONTAINERFILE

BUILD_TOOLS = ("podman", "docker")


class ImageBuildError(Exception):
    """The image could not be built; the message says which step and why."""


def jobgen_wheel(out_dir: Path, given: Path | None = None) -> Path:
    """jobgen's wheel for the image: ``given``, else one built from the checkout jobgen runs
    from. An installed jobgen has no source to build one from: the wheel it was installed from
    is given."""
    if given is not None:
        if not given.is_file() or not given.name.startswith("jobgen-") or given.suffix != ".whl":
            raise ImageBuildError(f"--wheel {given}: not a jobgen wheel file (jobgen-<version>-py3-none-any.whl)")
        return given
    if CHECKOUT is None:
        raise ImageBuildError("jobgen is installed, not run from a checkout: give the wheel it came from (--wheel)")
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--wheel-dir", str(out_dir), str(CHECKOUT)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    wheels = sorted(out_dir.glob("jobgen-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ImageBuildError(f"could not build jobgen's wheel from {CHECKOUT}: {proc.stderr.strip()[-500:]}")
    return wheels[-1]


def build_argv(tool: str, context: Path, base: str, tag: str, extras: str, pip_options: str) -> list[str]:
    """The build's command line (podman's and docker's read the same options)."""
    return [
        tool,
        "build",
        "--file",
        str(context / "Containerfile"),
        "--build-arg",
        f"BASE={base}",
        "--build-arg",
        f"EXTRAS={extras}",
        "--build-arg",
        f"PIP_OPTIONS={pip_options}",
        "--tag",
        tag,
        str(context),
    ]


def build_image(
    *,
    base: str,
    tag: str,
    wheels: Sequence[Path],
    extras: str = "train,lora",
    offline: bool = False,
    tool: str = "podman",
    log: Callable[[str], None] = print,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> str:
    """Build ``tag`` from ``base`` with ``wheels`` (jobgen's among them); ``offline``: pip looks
    nowhere but the wheels. Returns the tag."""
    # The arguments first, the machine after: the same call is refused the same way anywhere.
    if not any(w.name.startswith("jobgen-") for w in wheels):
        raise ImageBuildError("no jobgen wheel among the wheels to install")
    if tool not in BUILD_TOOLS or shutil.which(tool) is None:
        raise ImageBuildError(f"{tool!r} not found: the image is built with one of {', '.join(BUILD_TOOLS)}")
    with tempfile.TemporaryDirectory(prefix="jobgen-image-") as tmp:
        context = Path(tmp)
        shutil.copyfile(CONTAINERFILE, context / "Containerfile")
        (context / "wheels").mkdir()
        for wheel in wheels:
            target = context / "wheels" / wheel.name
            try:
                target.hardlink_to(wheel)  # a wheelhouse of torch is hundreds of MB: no copy where one filesystem
            except OSError:
                shutil.copyfile(wheel, target)
        argv = build_argv(tool, context, base, tag, extras, "--no-index" if offline else "")
        argv[2:2] = list(extra_args)
        log(f"building {tag} on {base}: {' '.join(argv[:2])} ...")
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0:
            raise ImageBuildError(f"{tool} build of {tag} failed:\n{(proc.stdout + proc.stderr).strip()[-2000:]}")
    return tag
