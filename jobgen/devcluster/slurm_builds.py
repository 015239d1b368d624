"""Which Slurm the dev cluster runs: this machine's own packages (Debian bookworm's slurm-wlm,
22.05, the default), or a newer release built once from Debian's source into a cache that every
later ``up`` reuses.

    jobgen cluster up --netns --slurm 24.11

A built release is Debian trixie's slurm-wlm source (the upstream tarball Debian ships, checked
against the sha256 in trixie's Sources index), configured for a prefix of its own under
``$JOBGEN_SLURM_CACHE`` (default /var/cache/jobgen/slurm): ``<cache>/<version>-<build>/{bin,sbin,lib}``.
The build (configure and ``make -j2``: 4 minutes on this project's 2-core machine, docs/testing.md)
happens under a lock, in a directory beside the prefix, and is renamed into place only when complete, so a
killed build leaves nothing that looks usable and two ``up``s at once build once. Its daemons and
clients talk to each other only: a 22.05 client cannot reach a 24.11 controller (Slurm speaks to
the two previous releases only), so the cluster's record names the prefix and whoever reaches the
cluster puts its ``bin`` first on PATH (``jobgen cluster status`` prints the line).

Only Debian's build dependencies that this build uses are installed (munge, MariaDB's client for
accounting_storage/mysql, json-c and yaml for ``--json``/``--yaml``); the cluster keeps using the
machine's munged and MariaDB server.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from jobgen.base.lease import exclusive

from .state import SYSTEM_SERIES, ClusterError

CACHE_ENV = "JOBGEN_SLURM_CACHE"
DEFAULT_CACHE = "/var/cache/jobgen/slurm"
DEBIAN_POOL = "http://deb.debian.org/debian/pool/main/s/slurm-wlm/"
# What a complete build leaves in its prefix; a prefix without it is not used.
COMPLETE = ".jobgen-complete"
# Debian packages the build needs (bookworm's names), besides a C compiler.
BUILD_PACKAGES = (
    "build-essential",
    "pkg-config",
    "python3",
    "libmunge-dev",
    "default-libmysqlclient-dev",
    "libjson-c-dev",
    "libyaml-dev",
    "liblz4-dev",
)
CONFIGURE_OPTIONS = (
    # The dev cluster's slurmds share one host's munged: each decodes the same launch credential,
    # which munged reports as replayed, and only a multiple-slurmd build takes that as expected
    # (24.11 without it: "_verify_signature: failed decode" on the second node; measured).
    "--enable-multiple-slurmd",
    "--disable-debug",
    "--disable-slurmrestd",
    "--with-munge=/usr",
    "--with-json=/usr",
    "--with-yaml=/usr",
    "--without-hdf5",
    "--without-pmix",
)


@dataclass(frozen=True)
class Release:
    """One Slurm release the dev cluster can build: its version and Debian's source tarball."""

    version: str
    tarball: str
    sha256: str
    pool: str = DEBIAN_POOL  # where the tarball is (a file:// folder in the tests)

    @property
    def url(self) -> str:
        return self.pool + self.tarball


# Debian trixie's slurm-wlm (Sources: slurm-wlm 24.11.5-4+deb13u1).
RELEASES = {
    "24.11": Release(
        version="24.11.5",
        tarball="slurm-wlm_24.11.5.orig.tar.gz",
        sha256="e1a5547edd212c38b5e3230a284133f777b32746551f094aaa81cc4af375e332",
    ),
}
SERIES = (SYSTEM_SERIES, *RELEASES)


def cache_root(environ: dict[str, str] | None = None) -> Path:
    return Path((environ if environ is not None else os.environ).get(CACHE_ENV) or DEFAULT_CACHE)


def build_name(release: Release) -> str:
    """The prefix's folder name: the version and what the build is made of, so that a build with
    other options is a build of its own, never an older one reused."""
    made_of = hashlib.sha256(" ".join([release.sha256, *CONFIGURE_OPTIONS]).encode()).hexdigest()
    return f"{release.version}-{made_of[:8]}"


def prefix_of(series: str, root: Path | None = None) -> Path | None:
    """Where ``series`` is installed: None for the machine's own packages."""
    if series == SYSTEM_SERIES:
        return None
    if series not in RELEASES:
        raise ClusterError(f"--slurm {series}: the dev cluster runs Slurm {', '.join(SERIES)}")
    return (root or cache_root()) / build_name(RELEASES[series])


def search_path(prefix: str | os.PathLike[str] | None, path: str) -> str:
    """``path`` with a built Slurm's sbin and bin in front (``path`` itself for the packages')."""
    if not prefix:
        return path
    return os.pathsep.join([f"{prefix}/sbin", f"{prefix}/bin", path])


def built(prefix: Path) -> bool:
    return (prefix / COMPLETE).is_file()


def ensure(series: str, log, apt_install, root: Path | None = None) -> Path | None:
    """The prefix of ``series``, built first if the cache has no complete one. ``log`` takes a
    line; ``apt_install`` installs Debian packages (the dev cluster's, so apt's hook applies)."""
    prefix = prefix_of(series, root)
    if prefix is None or built(prefix):
        return prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(prefix.parent / f".build-{prefix.name}.lock"):
        if built(prefix):  # another `up` built it while this one waited
            return prefix
        release = RELEASES[series]
        missing = [name for name in BUILD_PACKAGES if not _installed(name)]
        if missing:
            log(f"Slurm {release.version}: installing the build's packages {' '.join(missing)}")
            apt_install(missing)
        log(f"Slurm {release.version}: building into {prefix} (once; later `up`s reuse it)")
        build(release, prefix, log)
    return prefix


def build(release: Release, prefix: Path, log) -> None:
    """Download, check, configure, compile and install ``release`` into ``prefix``: staged
    beside it and renamed into place, complete or not at all."""
    shutil.rmtree(prefix, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f".build-{release.version}-", dir=prefix.parent) as work:
        work_dir = Path(work)
        source = _unpacked(release, work_dir)
        stage = work_dir / "stage"
        jobs = str(len(os.sched_getaffinity(0)))
        steps = [
            ["./configure", f"--prefix={prefix}", f"--sysconfdir={prefix}/etc", *CONFIGURE_OPTIONS],
            ["make", f"-j{jobs}"],
            ["make", "install", f"DESTDIR={stage}"],
        ]
        for step in steps:
            log(f"Slurm {release.version}: {' '.join(step[:2])}")
            run_logged(step, work_dir / "build.log", what="building Slurm", cwd=source)
        staged = stage / prefix.relative_to(prefix.anchor)
        (staged / COMPLETE).write_text(f"{release.version} {release.sha256}\n")
        os.replace(staged, prefix)


def _unpacked(release: Release, work: Path) -> Path:
    tarball = work / release.tarball
    with urllib.request.urlopen(release.url, timeout=120) as response, tarball.open("wb") as out:
        shutil.copyfileobj(response, out)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != release.sha256:
        raise ClusterError(f"{release.url}: sha256 {digest}, not Debian's {release.sha256}; not building it")
    with tarfile.open(tarball) as archive:
        archive.extractall(work / "src", filter="data")
    (top,) = (work / "src").iterdir()
    return top


def run_logged(argv: list[str], log_file: Path, *, what: str, cwd: Path | None = None) -> None:
    """One step of a dev-cluster build (Slurm's here, the image's in jobgen.devcluster.image), its
    output appended to ``log_file``; a failure is a ClusterError with the log's last lines."""
    with log_file.open("a") as out:
        proc = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
        raise ClusterError(f"{what}: `{' '.join(argv)}` failed (exit {proc.returncode}):\n{tail}")


def _installed(package: str) -> bool:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False)
    return proc.stdout == "install ok installed"  # not "... not-installed", not "deinstall ok config-files"
