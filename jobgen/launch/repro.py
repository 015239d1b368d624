"""What a job writes of its environment into ``repro/<jobid>/env.txt``.

The run directory is read by the whole team and kept for months, so the job
records a variable's value only when the variable helps reproduce the run (the
scheduler's, launcher's, NCCL/CUDA/torch/Hugging Face settings, search paths, the
run's own ``[env]``); every other variable is recorded by name alone. A credential
is never recorded, whatever list it is on: :func:`jobgen.spec.env_names.secret_problem`,
the rule that validates the spec's ``[env]``, decides (so ``HF_TOKEN`` and ``HFTOKEN``
stay out although ``HF_*`` is in, and a value holding ``scheme://user:password@`` or
a ``hf_...`` token under any name).

No URL leaves this module with its credentials: :func:`without_credentials` replaces the
userinfo of every URL (``https://oauth2:glpat-...@gitlab.example/x.git``, a token alone as
``https://TOKEN@host``, ``https://user:pass@index/simple``) by ``***``, and every writer here
passes what it writes through it: a recorded variable's value (an index or a mirror URL),
pip-freeze.txt's lines (a direct URL's ``url``, a VCS requirement's), versions.json's values.
The rest of the URL stays, so the record still names the host, the path and the commit.

The batch script pipes its environment in (``env -0 | python -m jobgen.launch.repro --own
NAME ...``), so the record is of the batch shell's own variables, on every kind of site.

``python -m jobgen.launch.repro --versions`` prints ``versions.json``: the interpreter, the
platform, and the torch, CUDA and NCCL versions as the environment installed them, read from
package metadata and torch's ``version.py`` without importing torch (:func:`installed_versions`):
every array task writes the record before its launch, and an import of torch there cost each
task about two CPU-seconds before the first rank started. ``--freeze`` prints
``pip-freeze.txt`` (:func:`installed_requirements`), `pip freeze`'s lines from the same
metadata: without pip, which a uv-made environment lacks.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from jobgen.spec.env_names import secret_problem

# Glob patterns on the variable's name (case-sensitive).
ENV_ALLOW = (
    # scheduler and launcher
    "SLURM_*",
    "SLURMD_NODENAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "JOBGEN_*",
    # communication and accelerators
    "NCCL_*",
    "GLOO_*",
    "UCX_*",
    "FI_*",
    "CUDA_*",
    "CUDNN_*",
    "CUBLAS_*",
    "NVIDIA_*",
    "TORCH_*",
    "TORCHELASTIC_*",
    "PYTORCH_*",
    # libraries and threads
    "HF_*",
    "TRANSFORMERS_*",
    "OMP_*",
    "MKL_*",
    "KMP_*",
    "OPENBLAS_*",
    # interpreter, environment and search paths
    "PYTHON*",
    "*PATH",
    "LD_PRELOAD",
    "LOADEDMODULES",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
    "HOSTNAME",
    "HOME",
    "USER",
    "PWD",
    "TMPDIR",
    "LANG",
    "LC_*",
    "TZ",
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
# A URL's scheme (from the start of its word: a long word is scanned once, not from each of its
# letters) and its userinfo: everything up to the last '@' before the authority ends (a '/', '?',
# '#' or a space), so that an unescaped '@' in a password is taken too.
_URL_USERINFO = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


def without_credentials(text: str) -> str:
    """``text`` with the userinfo of every URL in it (``user:password@``, ``token@``) replaced
    by ``***``: what every record written here goes through."""
    return _URL_USERINFO.sub(r"\1***@", text)


def recordable(name: str, value: str, own: Iterable[str] = ()) -> bool:
    """Whether env.txt may hold ``name``'s value: on the allow list (or one the spec itself
    exports, ``own``), and no credential by the one rule."""
    allowed = name in set(own) or any(fnmatch.fnmatchcase(name, pattern) for pattern in ENV_ALLOW)
    return allowed and secret_problem(name, value) is None


def shell_quoted(text: str) -> str:
    """``text`` on one line: as is, or as bash's $'...' when it holds a control character, so
    that a value cannot forge lines of its own."""
    if not _CONTROL.search(text):
        return text
    return "$'" + "".join(_ESCAPES.get(c, f"\\x{ord(c):02x}" if _CONTROL.match(c) else c) for c in text) + "'"


def env_lines(environ: Mapping[str, str], own: Iterable[str] = ()) -> list[str]:
    """env.txt's lines, sorted: ``NAME=value`` or ``NAME=<not recorded>``."""
    own = set(own)
    lines = []
    for name, value in environ.items():
        shown = shell_quoted(without_credentials(value)) if recordable(name, value, own) else "<not recorded>"
        lines.append(f"{shell_quoted(name)}={shown}")
    return sorted(lines)


def parse_env0(data: bytes) -> dict[str, str]:
    """``env -0``'s output: NAME=value entries ended by NUL bytes."""
    environ = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.decode("utf-8", "backslashreplace").partition("=")
        if sep and name:
            environ[name] = value
    return environ


def _literal_assignment(source: str, name: str) -> object:
    """The literal value assigned to ``name`` at the top of a module's source, or None."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        else:
            continue
        if value is not None and any(isinstance(t, ast.Name) and t.id == name for t in targets):
            try:
                return ast.literal_eval(value)
            except ValueError:
                return None
    return None


def _torch_cuda_version() -> str | None:
    """torch.version.cuda (None for a CPU build) from torch/version.py's text: parsed, not run."""
    spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    value = _literal_assignment(version_py.read_text(), "cuda") if version_py.is_file() else None
    return value if isinstance(value, str) else None


def _normalized(name: str) -> str:
    """A distribution's name as packaging compares names (PEP 503: case and -_. runs folded)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _nccl_version() -> str | None:
    """The NCCL that pip installed beside torch (the nvidia-nccl-cu* wheel torch loads), or None."""
    for dist in importlib.metadata.distributions():
        if _normalized(dist.metadata["Name"] or "").startswith("nvidia-nccl-cu"):
            return dist.version
    return None


# Never in `pip freeze`'s output either: the installer's own packages.
_FREEZE_SKIPS = frozenset({"pip", "setuptools", "wheel", "distribute"})


def _requirement(dist: importlib.metadata.Distribution) -> str:
    """One distribution as `pip freeze` writes it: ``name==version``, ``-e PATH`` for an editable
    install, ``name @ URL`` for one installed from a URL or a VCS checkout. (pip names an
    editable git checkout with a remote by its URL and commit; the record has the project's
    commit and diff beside it, git-commit.txt and git.diff.)"""
    name, version = dist.metadata["Name"], dist.version
    try:
        origin = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        origin = None
    if not isinstance(origin, dict) or not isinstance(origin.get("url"), str):
        return f"{name}=={version}"
    url = origin["url"]
    if isinstance(origin.get("dir_info"), dict) and origin["dir_info"].get("editable"):
        path = url.removeprefix("file://")
        return f"# Editable install ({name}=={version})\n-e {path}"
    vcs = origin.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("vcs") and vcs.get("commit_id"):
        return f"{name} @ {vcs['vcs']}+{url}@{vcs['commit_id']}"
    return f"{name} @ {url}"


def installed_requirements() -> list[str]:
    """pip-freeze.txt's lines: every distribution importable here, as `pip freeze` lists them
    (the first of a name on sys.path, sorted by name), from package metadata alone: no pip
    needed (a uv venv has none) and a tenth of its start-up. Like ``python -m pip``, the current
    directory is not searched: a checkout's ``*.egg-info`` there is not what is installed."""
    here = {"", os.getcwd()}
    found: dict[str, tuple[str, str]] = {}
    for dist in importlib.metadata.distributions(path=[p for p in sys.path if p not in here]):
        name = dist.metadata["Name"]
        key = _normalized(name or "")
        if not name or key in _FREEZE_SKIPS or key in found:
            continue
        found[key] = (name.lower(), without_credentials(_requirement(dist)))
    return [line for _, line in sorted(found.values())]


def installed_versions() -> dict[str, object]:
    """versions.json: what the job's Python environment holds, without importing torch."""
    info: dict[str, object] = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        info["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        info["torch"] = "unavailable: no torch in this environment"
    else:
        info["cuda"] = _torch_cuda_version()
        info["nccl"] = _nccl_version()
    return {key: without_credentials(value) if isinstance(value, str) else value for key, value in info.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobgen.launch.repro", description="env.txt from `env -0` on stdin")
    parser.add_argument("--own", action="append", default=[], metavar="NAME", help="a name the spec exports")
    record = parser.add_mutually_exclusive_group()
    record.add_argument("--versions", action="store_true", help="print versions.json instead (stdin unread)")
    record.add_argument("--freeze", action="store_true", help="print pip-freeze.txt instead (stdin unread)")
    args = parser.parse_args(argv)
    if args.versions:
        sys.stdout.write(json.dumps(installed_versions(), indent=2) + "\n")
        return 0
    if args.freeze:
        sys.stdout.write("".join(line + "\n" for line in installed_requirements()))
        return 0
    sys.stdout.write("".join(line + "\n" for line in env_lines(parse_env0(sys.stdin.buffer.read()), args.own)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
