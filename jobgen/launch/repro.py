"""What a job writes of its environment into ``repro/<jobid>/env.txt``.

The run directory is read by the whole team and kept for months, so the job
records a variable's value only when the variable helps reproduce the run (the
scheduler's, launcher's, NCCL/CUDA/torch/Hugging Face settings, search paths, the
run's own ``[env]``); every other variable is recorded by name alone. A credential
is never recorded, whatever list it is on: :func:`jobgen.spec.env_names.secret_problem`,
the rule that validates the spec's ``[env]``, decides (so ``HF_TOKEN`` and ``HFTOKEN``
stay out although ``HF_*`` is in, and a value holding ``scheme://user:password@`` or
a ``hf_...`` token under any name).

The batch script pipes its environment in (``env -0 | python -m jobgen.launch.repro --own
NAME ...``), so the record is of the batch shell's own variables, on every kind of site.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
from collections.abc import Iterable, Mapping

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
        shown = shell_quoted(value) if recordable(name, value, own) else "<not recorded>"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobgen.launch.repro", description="env.txt from `env -0` on stdin")
    parser.add_argument("--own", action="append", default=[], metavar="NAME", help="a name the spec exports")
    args = parser.parse_args(argv)
    sys.stdout.write("".join(line + "\n" for line in env_lines(parse_env0(sys.stdin.buffer.read()), args.own)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
