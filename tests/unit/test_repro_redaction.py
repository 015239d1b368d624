"""No credential of a URL reaches the reproducibility record ``repro/<jobid>/`` (issue 45): the
run directory is read by the whole team and kept for months.

A requirement installed from a private repository or index carries its credentials in its
``direct_url.json`` (``git+https://oauth2:glpat-...@gitlab.example/x.git``, a token alone as the
user, ``https://user:pass@files.example/x.whl``); a mirror's or an index's URL in an allowed
variable may carry one too; the project's checkout may have a remote with a token in it. Every
file the record's block writes is searched for each secret, and each URL must still be there
with its userinfo replaced by ``***`` (jobgen.launch.repro.without_credentials), so the record
still names the host, the path and the commit.

The distributions are fakes in a site directory of the test's own (a ``.dist-info`` each, put
on the interpreter's path), the checkout a git repository made here; the block is the one
rendered for a golden spec, run in bash with real git and this Python as test_repro.py runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import GOLDEN
from jobgen.launch import repro
from jobgen.launch.render import render
from jobgen.spec.loader import load_run

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Each secret, unlike any other text of the record, and the URL it is in.
SECRETS = {
    "glpat-gitlabsecret0123456789ab": "https://oauth2:glpat-gitlabsecret0123456789ab@gitlab.example/team/private-lib.git",
    "wheelpass1": "https://alice:wheelpass1@files.example/simple/jobgen-fake-archive-2.0-py3-none-any.whl",
    "bareusertoken2": "https://bareusertoken2@github.example/org/tool.git",
    "p@sswith3": "https://bob:p@sswith3@pypi.example/packages/jobgen_fake_direct-4.0.tar.gz",
    "remotetoken4": "https://x-access-token:remotetoken4@github.example/org/checkout.git",
    "mirrortoken5": "https://mirrortoken5@mirror.example/hf",
    "indextoken6": "https://__token__:indextoken6@pypi.example/simple",
    "indextoken7": "https://indextoken7@pypi.example/simple",
}


def _url(secret: str) -> str:
    return SECRETS[secret]


def _redacted(secret: str) -> str:
    """The URL as the record keeps it: the same but for its userinfo."""
    url = _url(secret)
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def _distribution(site: Path, name: str, version: str, origin: dict | None) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if origin is not None:
        (info / "direct_url.json").write_text(json.dumps(origin))


def _checkout(tmp_path: Path) -> Path:
    """A project checkout whose remote has a token in its URL (as `git clone https://TOKEN@...` leaves)."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example"]
    subprocess.run([*git, "init", "-q"], check=True)
    (checkout / "train.py").write_text("print('hi')\n")
    subprocess.run([*git, "add", "train.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    subprocess.run([*git, "remote", "add", "origin", _url("remotetoken4")], check=True)
    (checkout / "train.py").write_text("print('changed')\n")  # a diff and a status to record
    return checkout


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A site directory of fake distributions installed from URLs with credentials."""
    site = tmp_path / "site"
    vcs = {"vcs": "git", "commit_id": COMMIT, "requested_revision": "main"}
    _distribution(
        site, "jobgen-fake-private-lib", "1.0", {"url": _url("glpat-gitlabsecret0123456789ab"), "vcs_info": vcs}
    )
    archive = {"url": _url("wheelpass1"), "archive_info": {"hash": "sha256=" + "0" * 64}}
    _distribution(site, "jobgen-fake-archive", "2.0", archive)
    _distribution(site, "jobgen-fake-tool", "3.0", {"url": _url("bareusertoken2"), "vcs_info": vcs})
    _distribution(site, "jobgen-fake-direct", "4.0", {"url": _url("p@sswith3"), "archive_info": {}})
    checkout = _checkout(tmp_path)
    editable = {"url": checkout.as_uri(), "dir_info": {"editable": True}}
    _distribution(site, "jobgen-fake-editable", "5.0", editable)
    _distribution(site, "jobgen-fake-plain", "6.0", None)
    return site


EXPECTED_FREEZE = [
    "jobgen-fake-archive @ " + _redacted("wheelpass1"),
    "jobgen-fake-direct @ " + _redacted("p@sswith3"),
    # pip names an editable checkout with a remote by that remote's URL: jobgen by its path
    "# Editable install (jobgen-fake-editable==5.0)\n-e {checkout}",
    "jobgen-fake-plain==6.0",
    f"jobgen-fake-private-lib @ git+{_redacted('glpat-gitlabsecret0123456789ab')}@{COMMIT}",
    f"jobgen-fake-tool @ git+{_redacted('bareusertoken2')}@{COMMIT}",
]


def _ours(lines: list[str]) -> list[str]:
    return [line for line in lines if "jobgen-fake-" in line]


def test_the_freeze_lines_keep_each_url_but_its_credentials(site: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(site))
    expected = [line.format(checkout=site.parent / "checkout") for line in EXPECTED_FREEZE]
    assert _ours(repro.installed_requirements()) == expected


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (_url("mirrortoken5"), _redacted("mirrortoken5")),  # the URL of a mirror, an index
        (  # every URL of a value
            f"a list: {_url('mirrortoken5')} {_url('indextoken7')}",
            f"a list: {_redacted('mirrortoken5')} {_redacted('indextoken7')}",
        ),
        ("https://mirror.example/hf", "https://mirror.example/hf"),  # nothing to take away
        ("git@github.example:org/repo.git", "git@github.example:org/repo.git"),  # no URL: a user, no secret
    ],
)
def test_a_recorded_value_keeps_its_url_but_its_credentials(value: str, shown: str):
    """An allowed variable (HF_*) or one the spec exports (--own) whose value is a URL with a
    token as its user: recorded without it. (A user:password is no value to record at all,
    jobgen.spec.env_names.secret_problem says, and stays `<not recorded>`.)"""
    lines = repro.env_lines({"HF_ENDPOINT": value, "PIP_INDEX_URL": value}, own=["PIP_INDEX_URL"])
    assert lines == [f"HF_ENDPOINT={shown}", f"PIP_INDEX_URL={shown}"]
    assert repro.env_lines({"HF_ENDPOINT": _url("indextoken6")}) == ["HF_ENDPOINT=<not recorded>"]


def test_the_redaction_is_one_function_of_every_url_form():
    for secret in SECRETS:
        assert repro.without_credentials(_url(secret)) == _redacted(secret)
        assert repro.without_credentials(f"x git+{_url(secret)}@{COMMIT} y") == f"x git+{_redacted(secret)}@{COMMIT} y"
    assert repro.without_credentials("https://h.example:8080/a?b=c@d#e@f") == "https://h.example:8080/a?b=c@d#e@f"


def repro_section(text: str) -> str:
    """The rendered reproducibility block, from its heading to the end of its brace group."""
    start = text.index("# --- Reproducibility record")
    end = text.index('} 2>"$REPRO_DIR/errors.txt"', start)
    return text[start : text.index("\n", end) + 1]


def test_no_file_of_the_record_holds_a_credential(site: Path, tmp_path: Path):
    """The whole block, as a job runs it: env.txt, nodes, git state of a checkout whose remote
    has a token, pip-freeze.txt and versions.json. No secret in any file; the URLs still there."""
    checkout = site.parent / "checkout"
    stubs = (
        'log() { echo "$*" >&2; }\nnode_names() { echo node1; }\non_slurm() { false; }\n'
        f'git() {{ command git -C {checkout} "${{@:3}}"; }}\n'  # the block's `git -C PROJECT_ROOT ...`
        f'py_on_head() {{ if [[ "$1" == python ]]; then shift; {sys.executable} "$@"; else "$@"; fi; }}\n'
    )
    block = repro_section(render(load_run(GOLDEN / "specs" / "bare-train.toml")))
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "42",
        "RUN_DIR": str(tmp_path / "run"),
        "PYTHONPATH": str(site),
        "HF_ENDPOINT": _url("mirrortoken5"),
    }
    script = f"set -euo pipefail\n{stubs}{block}"
    subprocess.run(["bash", "-c", script], env=env, check=True, stdin=subprocess.DEVNULL, timeout=120)
    record = tmp_path / "run" / "repro" / "42"
    files = {p.name: p.read_text(errors="replace") for p in record.iterdir()}
    assert {"env.txt", "git-commit.txt", "git-status.txt", "git.diff", "pip-freeze.txt", "versions.json"} <= set(files)
    assert files["errors.txt"] == "", files["errors.txt"]
    leaks = [f"{name}: {secret}" for name, text in files.items() for secret in SECRETS if secret in text]
    assert not leaks, leaks
    freeze = files["pip-freeze.txt"]
    assert all(line.format(checkout=checkout) in freeze for line in EXPECTED_FREEZE), freeze
    assert f"HF_ENDPOINT={_redacted('mirrortoken5')}" in files["env.txt"].splitlines(), files["env.txt"]
    assert "train.py" in files["git-status.txt"] and "changed" in files["git.diff"]
