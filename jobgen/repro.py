"""What a job writes of its environment into ``repro/<jobid>/env.txt``.

The run directory is read by the whole team and kept for months, so the job
records a variable's value only when the variable helps reproduce the run (the
scheduler's, launcher's, NCCL/CUDA/torch/Hugging Face settings, search paths, the
run's own ``[env]``); every other variable is recorded by name alone. A deny list
wins over the allow list, so ``HF_TOKEN`` stays out although ``HF_*`` is in, and a
value holding ``scheme://user:password@`` never passes under any name. The lists
are data here; the template (``_repro.j2``) turns them into ``case`` patterns.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

# Glob patterns on the variable's name (case-sensitive, as the shell's `case` matches).
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
# Substrings of the upper-cased name that mark a secret, inside the allow list too.
ENV_DENY = ("TOKEN", "SECRET", "PASS", "KEY", "CREDENTIAL", "AUTH", "PRIVATE", "COOKIE", "WEBHOOK")

# Only letters, digits, '_' and a leading or trailing '*': safe unquoted in a `case` pattern.
_PATTERN = re.compile(r"^\*?[A-Za-z0-9_]+\*?$")


def _case_patterns(patterns: Iterable[str]) -> str:
    out = list(patterns)
    for pattern in out:
        if not _PATTERN.match(pattern):
            # Names come from this module and from validated [env] keys; reaching here is a bug.
            raise ValueError(f"refusing {pattern!r} as an environment name pattern")
    return "|".join(out)


def env_record_patterns(spec_env: Iterable[str] = ()) -> dict[str, str]:
    """``case`` patterns for the job script: ``allow`` (names whose value is recorded,
    plus the names the spec exports itself) and ``deny`` (matched against the upper-cased
    name, winning over ``allow``)."""
    # A name the list already covers would be a dead `case` branch (shellcheck SC2222).
    own = sorted(n for n in set(spec_env) if not any(fnmatch.fnmatchcase(n, p) for p in ENV_ALLOW))
    return {
        "allow": _case_patterns([*ENV_ALLOW, *own]),
        "deny": _case_patterns(f"*{word}*" for word in ENV_DENY),
    }
