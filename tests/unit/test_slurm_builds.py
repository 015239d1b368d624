"""The dev cluster's built Slurm releases (jobgen.devcluster.slurm_builds), with a stand-in
source tarball served from a file:// folder: a build lands in its prefix complete or not at all,
a tarball that is not Debian's is refused, and a complete prefix is reused without a build. The
real build of 24.11 is exercised by `jobgen cluster up --slurm 24.11` (README, tests on 24.11)."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from jobgen.devcluster import slurm_builds
from jobgen.devcluster.state import ClusterError

# configure records the prefix; make's install leaves bin/sinfo under DESTDIR + prefix.
CONFIGURE = '#!/bin/sh\necho "PREFIX=${1#--prefix=}" > config.mk\n'
MAKEFILE = """include config.mk
all:
\t{build}
install:
\tmkdir -p $(DESTDIR)$(PREFIX)/bin
\techo 'echo slurm 24.11.5' > $(DESTDIR)$(PREFIX)/bin/sinfo
"""


def source_tarball(folder: Path, name: str, *, broken: bool = False) -> slurm_builds.Release:
    """A stand-in source tree; ``broken``: its compile step fails as a compiler would."""
    build = "echo 'src/common/log.c: error: something broke'; exit 2" if broken else "true"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path, text in {"configure": CONFIGURE, "Makefile": MAKEFILE.format(build=build)}.items():
            info = tarfile.TarInfo(f"slurm-top/{path}")
            data = text.encode()
            info.size, info.mode = len(data), 0o755
            archive.addfile(info, io.BytesIO(data))
    (folder / name).write_bytes(buffer.getvalue())
    digest = hashlib.sha256(buffer.getvalue()).hexdigest()
    return slurm_builds.Release(version="24.11.5", tarball=name, sha256=digest, pool=f"file://{folder}/")


def test_a_build_lands_complete_in_its_prefix(tmp_path):
    release = source_tarball(tmp_path, "good.tar.gz")
    prefix = tmp_path / "cache" / "24.11.5"
    prefix.parent.mkdir()
    lines: list[str] = []
    slurm_builds.build(release, prefix, lines.append)
    assert slurm_builds.built(prefix)
    assert (prefix / "bin" / "sinfo").read_text() == "echo slurm 24.11.5\n"
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["24.11.5"]  # no build folder left
    assert any("configure" in line for line in lines) and any("make install" in line for line in lines)


def test_a_failed_build_leaves_no_prefix_and_says_why(tmp_path):
    release = source_tarball(tmp_path, "broken.tar.gz", broken=True)
    prefix = tmp_path / "cache" / "24.11.5"
    prefix.parent.mkdir()
    with pytest.raises(ClusterError, match=r"`make -j\d+` failed \(exit 2\)") as failure:
        slurm_builds.build(release, prefix, lambda line: None)
    assert "src/common/log.c: error: something broke" in str(failure.value)
    assert list(prefix.parent.iterdir()) == []


def test_a_tarball_that_is_not_debians_is_not_built(tmp_path):
    release = source_tarball(tmp_path, "good.tar.gz")
    forged = slurm_builds.Release(release.version, release.tarball, "0" * 64, release.pool)
    prefix = tmp_path / "cache" / "24.11.5"
    prefix.parent.mkdir()
    with pytest.raises(ClusterError, match="not Debian's 0000"):
        slurm_builds.build(forged, prefix, lambda line: None)
    assert list(prefix.parent.iterdir()) == []


def test_a_complete_prefix_is_reused_and_the_packages_series_needs_none(tmp_path, monkeypatch):
    prefix = tmp_path / slurm_builds.build_name(slurm_builds.RELEASES["24.11"])
    (prefix / "bin").mkdir(parents=True)
    (prefix / slurm_builds.COMPLETE).write_text("24.11.5\n")

    def must_not(*args):
        raise AssertionError("built or installed again")

    monkeypatch.setattr(slurm_builds, "build", must_not)
    assert slurm_builds.ensure("24.11", must_not, must_not, root=tmp_path) == prefix
    assert slurm_builds.ensure("22.05", must_not, must_not, root=tmp_path) is None


def test_an_unknown_series_is_refused_with_the_ones_there_are():
    with pytest.raises(ClusterError, match=r"--slurm 23.02: the dev cluster runs Slurm 22.05, 24.11"):
        slurm_builds.prefix_of("23.02")


def test_a_built_releases_programs_come_first_on_the_path():
    assert slurm_builds.search_path("/c/24.11.5", "/usr/bin:/bin") == "/c/24.11.5/sbin:/c/24.11.5/bin:/usr/bin:/bin"
    assert slurm_builds.search_path("", "/usr/bin:/bin") == "/usr/bin:/bin"
