"""Which environment variables a spec may set, and which values jobgen never writes down.

Two rules, one place, used by every writer of environment values: the spec's and the site's
``env`` tables (validated here before anything reaches run.toml's copy, spec.json or the batch
script) and the job's record of its environment (``repro/<job>/env.txt``, :mod:`jobgen.launch.repro`):

- :func:`secret_problem`: a credential, by its name (HF_TOKEN, HFTOKEN, OPENAIAPIKEY,
  GITHUB_PAT, DATABASE_URL, SENTRY_DSN...) or by its value (``scheme://user:password@host``,
  a token of a well-known shape such as ``hf_...`` or ``ghp_...``, whatever the name);
- :func:`reserved_problem`: a name that the batch script, Slurm, torchrun or the shell owns
  (RUN_DIR, SLURM_JOB_ID, RANK, IFS...), which an export in ``[env]`` would take from them.
"""

from __future__ import annotations

import re

# ---------------------------------------------------------------- credentials

# Words of a name (split at '_', trailing digits dropped) that make it a credential wherever
# they stand: HF_TOKEN, WANDB_API_KEY, MY_PASSWORD, GITHUB_PAT, SENTRY_DSN, MYSQL_PWD. Whole
# words: TOKENIZERS_PARALLELISM and MAX_NEW_TOKENS are none.
SECRET_WORDS = frozenset(
    {"TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PASSPHRASE", "PASSCODE", "PWD"}
    | {"KEY", "KEYS", "APIKEY", "CREDENTIAL", "CREDENTIALS", "CREDS", "AUTH", "AUTHORIZATION", "PRIVATE"}
    | {"COOKIE", "COOKIES", "SESSION", "WEBHOOK", "PAT", "DSN", "JWT", "BEARER", "OTP"}
)
# Endings of a word written without separators (HFTOKEN, OPENAIAPIKEY, WANDBKEY, DBPASSWORD).
# PASS, PAT and PWD are left out as endings: BYPASS, COMPASS, COMPAT and OLDPWD are no secrets.
GLUED_ENDINGS = (
    "TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "KEY", "CREDENTIAL", "CREDENTIALS", "CREDS",
    "AUTH", "COOKIE", "WEBHOOK", "DSN",
)  # fmt: skip
# Whole words with such an ending that hold no secret (MONKEY_PATCH, HOTKEY).
PLAIN_WORDS = frozenset({"MONKEY", "DONKEY", "TURKEY", "HOCKEY", "JOCKEY", "WHISKEY", "LACKEY", "HOTKEY", "HOKEY"})
# The shell's own names that look like one (the working directories).
PLAIN_NAMES = frozenset({"PWD", "OLDPWD"})
# A URL or connection string naming one of these services carries its password more often than
# not (DATABASE_URL, REDIS_URL, MONGODB_URI): refused by name, whatever the value shows.
CONNECTION_WORDS = frozenset(
    {"DATABASE", "DB", "POSTGRES", "POSTGRESQL", "PG", "MYSQL", "MARIADB", "MONGO", "MONGODB", "REDIS"}
    | {"AMQP", "RABBITMQ", "BROKER", "SQLALCHEMY", "CONNECTION", "CONN"}
)
CONNECTION_ENDINGS = frozenset({"URL", "URI", "URLS", "STRING", "STR"})
# A value that can hold no credential: a switch. HF_HUB_DISABLE_IMPLICIT_TOKEN = "1" is a setting.
_FLAG = re.compile(r"^(?:|0|1|true|false|yes|no|on|off)$", re.IGNORECASE)
# user:password@ in a URL (a proxy, a package index, a database), under any name.
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s:]*:[^/?#@\s]*@")
# Tokens whose shape says what they are (Hugging Face, GitHub, GitLab, OpenAI-style, Slack, AWS).
_TOKEN_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"
    r"|glpat-[A-Za-z0-9_-]{20,}|sk-[A-Za-z0-9_-]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})"
)


def _words(name: str) -> list[str]:
    return [word.rstrip("0123456789") for word in name.upper().split("_") if word.rstrip("0123456789")]


def secret_name(name: str) -> bool:
    """Whether ``name`` is a credential's name (see SECRET_WORDS, GLUED_ENDINGS, CONNECTION_WORDS)."""
    if name.upper() in PLAIN_NAMES:
        return False
    words = _words(name)
    for word in words:
        if word in SECRET_WORDS:
            return True
        if word not in PLAIN_WORDS and word.endswith(GLUED_ENDINGS):
            return True
    # DATABASE_URL, MONGODB_URI, AZURE_STORAGE_CONNECTION_STRING
    return len(words) > 1 and words[-1] in CONNECTION_ENDINGS and any(w in CONNECTION_WORDS for w in words[:-1])


def secret_value(value: str) -> str | None:
    """What in ``value`` is a credential whatever its name, or None."""
    if _URL_PASSWORD.search(value):
        return "a password in a URL (scheme://user:password@host)"
    if _TOKEN_SHAPES.search(value):
        return "a token of a well-known kind (hf_..., ghp_..., sk-..., AKIA...)"
    return None


def secret_problem(name: str, value: str) -> str | None:
    """Why ``name = value`` must not be written into a file of the run ("<name> looks like a
    secret", "<name> has ... in its value"), or None. The one check
    for every writer of environment values: the spec's and site's env tables, the job's env.txt."""
    found = secret_value(value)
    if found:
        return f"has {found} in its value"
    if secret_name(name) and not _FLAG.match(value.strip()):
        return "looks like a secret"
    return None


# ---------------------------------------------------------------- names others own

# Variables the rendered batch, node, sweep and serve scripts assign for their own use
# (sbatch_templates/*.j2): exported over them, a value would move the run's records
# elsewhere (RUN_DIR) or change how the script decides (status, CAUGHT). Complete:
# tests/unit/test_env_names.py reads every assignment in the templates and checks that
# each name is here or in SCRIPT_DEFAULTS.
SCRIPT_OWNED = frozenset(
    {"EXPECTED_NODES", "HEAD_ADDR", "HEAD_NODE", "IS_HOST", "NODE_ADDR", "NODE_LAUNCH", "NODE_NAMES"}
    | {"NODE_PROBE", "NODE_PROCS", "NODE_THREADS", "NPROC", "PLANNED_EXIT_CODES", "POINT_DIR", "POINT_LOG"}
    | {"POINT_SCRIPT", "PYTHONPATH", "RDZV_PORT", "REPRO_DIR", "RUN_DIR", "SERVE", "SERVE_PID"}
    | {"SRUN_CONTAINER", "SWEEP_DIR", "SWITCHES", "TASK_RECORD", "TASK_WORLD_SIZE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    # the scripts' lower-case working variables
    | {"answer", "blamed", "code", "deadline", "end", "given", "given_count", "gpus", "line"}
    | {"live", "marker", "node", "out", "outcome", "probe_failed", "probe_out", "python_env", "s"}
    | {"slurm_exit", "status", "switch", "task", "tasks", "throttle", "tmp", "why", "words"}
)
# Settings the scripts export as defaults, which the site's network.env and the run's [env]
# are there to change: they are exported after the script's own (docs/run-toml.md).
SCRIPT_DEFAULTS = frozenset(
    {"OMP_NUM_THREADS", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_NET"}
    | {"NCCL_IB_HCA", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    | {"TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "PYTHONNOUSERSITE"}
)
# Prefixes of names that belong to Slurm (its output and srun's input variables, the MPI
# plumbing it sets up) and to jobgen itself (JOBGEN_LOCAL, JOBGEN_RUN_DIR...).
OWNED_PREFIXES = {
    "SLURM": "Slurm sets it for the job (Slurm options belong in the site's slurm table or slurm.extra_sbatch)",
    "SBATCH_": "sbatch reads it (Slurm options belong in the site's slurm table or slurm.extra_sbatch)",
    "SALLOC_": "salloc reads it (Slurm options belong in the site's slurm table or slurm.extra_sbatch)",
    "SRUN_": "srun reads it as an option for every step of the job",
    "PMI_": "Slurm's process management sets it",
    "PMIX_": "Slurm's process management sets it",
    "JOBGEN_": "jobgen sets it for the job",
    "TORCHELASTIC_": "torchrun sets it for every process",
    "TORCH_ELASTIC_": "torchrun reads it",
    "BASH_": "bash sets it",
}
# torchrun's per-process variables and the devices Slurm's GPU allocation hands out.
LAUNCHER_NAMES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK"}
    | {"ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}
)
DEVICE_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES"})
# The shell's own variables, and those that change how every bash the job starts behaves
# (BASH_ENV, ENV: a file sourced first; SHELLOPTS, BASHOPTS: read-only, an export kills the
# script; TMOUT: times out the script's `read`s). PATH is the site's Python environment's.
SHELL_NAMES = frozenset(
    {"IFS", "PATH", "ENV", "PS4", "SHELLOPTS", "BASHOPTS", "BASHPID", "PROMPT_COMMAND", "CDPATH", "GLOBIGNORE"}
    | {"TMOUT", "POSIXLY_CORRECT", "FUNCNAME", "GROUPS", "EUID", "UID", "PPID", "RANDOM", "SRANDOM", "SECONDS"}
    | {"LINENO", "OPTIND", "OPTARG", "OPTERR", "SHLVL", "PWD", "OLDPWD", "EPOCHSECONDS", "EPOCHREALTIME"}
)
_ADVICE = {
    "PATH": "the site's [python] sets the job's PATH (venv, modules or container): add your tools there",
    "PYTHONPATH": "jobgen puts its own checkout on it for every process: install your package into the site's "
    "venv, or start your program from its directory (command.workdir)",
}


def reserved_problem(name: str) -> str | None:
    """Why [env] may not set ``name``, or None: the batch script, Slurm, torchrun or the shell
    owns it. Users legitimately set LD_LIBRARY_PATH, LD_PRELOAD, HOME and TMPDIR, which none
    of them sets for the job: those stay allowed."""
    if name in _ADVICE:
        return f"{name} cannot be set here: {_ADVICE[name]}"
    if name in SCRIPT_OWNED:
        return f"{name} is a variable of jobgen's batch script itself: exporting it would change what the script does"
    for prefix, who in OWNED_PREFIXES.items():
        if name.startswith(prefix):
            return f"{name} cannot be set here: {who}"
    if name in LAUNCHER_NAMES:
        return f"{name} cannot be set here: torchrun sets it for every process"
    if name in DEVICE_NAMES:
        return f"{name} cannot be set here: Slurm sets it to the GPUs it allocated to the job"
    if name in SHELL_NAMES:
        return f"{name} cannot be set here: it belongs to the shell that runs the batch script"
    return None
