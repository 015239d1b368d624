"""The dev cluster's container image, for podman jobs (``[python] kind = "container"``,
``container_runtime = "podman"``): Debian bookworm's Python from debootstrap, with this jobgen and
the trainer's packages (torch's CPU build) installed by the bundled Containerfile, as a site's
image is (:mod:`jobgen.sites.image`). No registry is reached: the base is imported from a root
filesystem, and the build installs from a wheelhouse made here with pip, offline.

    jobgen image dev          (prints the image's name and the CONTAINERS_CONF to use)

Made once and kept: the base (``localhost/jobgen-base:bookworm-<recipe>``) and the image
(``localhost/jobgen-dev:<key>``) in podman's own storage, the wheelhouse under
``$JOBGEN_IMAGE_CACHE`` (default /var/cache/jobgen/images). The image's key is what it is made of:
the base, the Containerfile, jobgen's version and the wheels of its dependencies (so a changed
dependency makes a new image; a code change of jobgen does not: a job started from a checkout runs
the checkout's code, mounted and first on PYTHONPATH). Measured here: the base 50 s, the
wheelhouse 20 s, the build 72 s; later calls return at once. All of it under one lock.

podman's own settings for this machine go in ``<cache>/containers.conf`` (the job's
CONTAINERS_CONF): the OCI runtime and the limits that start a container here, found by trying
(on this project's VM crun refuses the hybrid cgroup hierarchy and the default RLIMIT_NPROC is
beyond what the kernel lets root raise).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from jobgen import __version__
from jobgen.base.atomic import write_text_atomic
from jobgen.base.lease import exclusive
from jobgen.base.paths import CHECKOUT, CONTAINERFILE

from .slurm_builds import run_logged
from .state import ClusterError

CACHE_ENV = "JOBGEN_IMAGE_CACHE"
DEFAULT_CACHE = "/var/cache/jobgen/images"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# What the steps run in the image: Python with venv, `ip` (the head node's address), `ps`.
BASE_PACKAGES = ("python3", "python3-venv", "iproute2", "procps", "ca-certificates")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_PACKAGES = ("podman", "runc", "debootstrap")
EXTRAS = "train,lora"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def base_tag() -> str:
    return f"localhost/jobgen-base:{SUITE}-{_digest(SUITE, MIRROR, *BASE_PACKAGES)}"


def podman(*args: str, conf: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"CONTAINERS_CONF": str(conf)} if conf else {})}
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, check=False)
    if check and proc.returncode != 0:
        raise ClusterError(f"`podman {' '.join(args[:3])} ...` failed: {(proc.stdout + proc.stderr).strip()[-1500:]}")
    return proc


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def ensure_base(log) -> str:
    """The base image: a debootstrap of Debian's Python, imported into podman."""
    tag = base_tag()
    if image_exists(tag):
        return tag
    cache = cache_root()
    with tempfile.TemporaryDirectory(prefix="jobgen-rootfs-", dir=cache) as work:
        root = Path(work) / "root"
        log(f"image: debootstrap {SUITE} with {' '.join(BASE_PACKAGES)}")
        argv = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(root), MIRROR]
        run_logged(argv, Path(work) / "debootstrap.log", what="building the dev image's base")
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        proc = subprocess.run(
            ["podman", "import", "--change", f"ENV PATH={DEFAULT_PATH}", "--change", 'CMD ["/bin/bash"]', "-", tag],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            check=False,
        )
        tar.wait()
        if proc.returncode != 0 or tar.returncode != 0:
            raise ClusterError(f"podman import of {tag} failed: {proc.stderr.strip()[-1500:]}")
    return tag


def wheelhouse(log) -> Path:
    """The wheels of jobgen's dependencies (torch at this environment's version), made once per
    set of requirements; jobgen's own wheel is built fresh beside them."""
    torch_version = importlib.metadata.version("torch").split("+")[0]
    requires = sorted(importlib.metadata.requires("jobgen") or [])
    key = _digest(sys.version.split()[0], torch_version, EXTRAS, *requires)
    house = cache_root() / f"wheels-{key}"
    if (house / ".complete").is_file():
        return house
    if CHECKOUT is None:
        raise ClusterError("the dev image is built from a jobgen checkout (pip install -e); this jobgen is installed")
    log(f"image: pip wheel torch=={torch_version} and jobgen[{EXTRAS}]'s dependencies into {house}")
    shutil.rmtree(house, ignore_errors=True)
    stage = Path(tempfile.mkdtemp(prefix=".wheels-", dir=cache_root()))
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(stage), f"torch=={torch_version}"]
    run_logged([*argv, f"{CHECKOUT}[{EXTRAS}]"], stage / "pip.log", what="making the dev image's wheelhouse")
    for built in stage.glob("jobgen-*.whl"):  # jobgen's own is built fresh for each image
        built.unlink()
    (stage / ".complete").write_text(f"{key}\n")
    os.replace(stage, house)
    return house


def containers_conf(base: str, log) -> Path:
    """podman's settings for this machine: the OCI runtime and limits that start a container here."""
    conf = cache_root() / "containers.conf"
    if conf.is_file():
        return conf
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc_hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    for runtime in ("crun", "runc"):
        if shutil.which(runtime) is None:
            continue
        for nproc in sorted({nproc_hard, 65536, 32768, 16384, 4096}, reverse=True):
            text = (
                "# jobgen's dev cluster: what starts a container on this machine (jobgen.devcluster.image).\n"
                f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
                f'[engine]\nruntime = "{runtime}"\n'
            )
            write_text_atomic(conf.with_suffix(".try"), text)
            if (
                podman(
                    "run", "--rm", "--network=none", base, "true", conf=conf.with_suffix(".try"), check=False
                ).returncode
                == 0
            ):
                os.replace(conf.with_suffix(".try"), conf)
                log(f"image: podman starts containers here with {runtime}, nproc {nproc}: {conf}")
                return conf
    raise ClusterError("podman cannot start a container on this machine with crun or runc (see `podman run` errors)")


def dev_image(build, log=print) -> tuple[str, Path]:
    """The dev cluster's image (built if missing) and the CONTAINERS_CONF its jobs use. ``build``
    makes it: ``build(base=, tag=, wheels=, env=)`` with jobgen's wheel added
    (:func:`jobgen.sites.image.build_image`, which the composition root hands over)."""
    missing = [name for name in HOST_PACKAGES if shutil.which(name) is None]
    if missing:
        from .daemons import apt_install

        log(f"image: installing {' '.join(missing)}")
        apt_install(missing)
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    with exclusive(cache / ".build.lock"):
        base = ensure_base(log)
        conf = containers_conf(base, log)
        house = wheelhouse(log)
        deps = sorted(house.glob("*.whl"))
        tag = f"localhost/jobgen-dev:{_digest(base, CONTAINERFILE.read_text(), __version__, *(p.name for p in deps))}"
        if not image_exists(tag):
            build(base=base, tag=tag, wheels=deps, env={**os.environ, "CONTAINERS_CONF": str(conf)})
    return tag, conf
