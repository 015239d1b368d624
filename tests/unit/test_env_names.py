"""Which names [env] may set (issue 30, items 5 and 6): no credential written in plain text, by
its name however it is spelled or by its value whatever the name, and no name the batch script,
Slurm, torchrun or the shell owns; the list of the script's own names is checked against every
variable the templates assign, so it cannot go stale."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers import GOLDEN, run_spec, spec_issues
from jobgen.base.paths import TEMPLATES_DIR
from jobgen.launch.render import render
from jobgen.spec.env_names import SCRIPT_DEFAULTS, SCRIPT_OWNED, reserved_problem, secret_problem
from jobgen.spec.loader import load_run

TEMPLATES = TEMPLATES_DIR

# Credentials by name, with a literal value: each must be refused.
MUST_REFUSE = [
    "HF_TOKEN", "HFTOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "OPENAIAPIKEY", "WANDBKEY", "WANDB_API_KEY",
    "GITHUB_PAT", "GH_TOKEN", "DATABASE_URL", "REDIS_URL", "MONGODB_URI", "AZURE_STORAGE_CONNECTION_STRING",
    "SENTRY_DSN", "SENTRYDSN", "MY_PASSWORD", "DBPASSWORD", "MYSQL_PWD", "AWS_SECRET_ACCESS_KEY",
    "AWSSECRETACCESSKEY", "SSH_PRIVATE_KEY", "PRIVATE_KEY", "SESSION_COOKIE", "AUTH_HEADER", "OAUTH",
    "SLACK_WEBHOOK_URL", "API_KEY2", "JWT_SECRET", "my_api_key", "SMTP_PASS", "API_KEYS",
]  # fmt: skip
# Settings whose names hold the letters of one, or a credential's word as a plain setting.
MUST_ALLOW = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "NCCL_IB_HCA": "mlx5",
    "NCCL_DEBUG": "INFO",
    "NCCL_SOCKET_NTHREADS": "4",
    "NCCL_NSOCKS_PERTHREAD": "2",
    "HF_HUB_OFFLINE": "1",
    "HF_HOME": "/shared/hf",
    "MONKEY_PATCH": "1",
    "KEYBOARD_LAYOUT": "us",
    "HOTKEY": "f5",
    "MAX_NEW_TOKENS": "64",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",  # a switch: no value of it is a credential
    "WANDB_BASE_URL": "https://api.wandb.ai",
    "MLFLOW_TRACKING_URI": "http://mlflow.internal:5000",
    "GIT_URL": "ssh://git@github.com/org/repo",  # a user name, no password
    "PIP_INDEX_URL": "https://pypi.org/simple",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor",
    "BYPASS_PROXY": "1",
    "COMPAT_MODE": "on",
    "LD_LIBRARY_PATH": "/opt/nccl/lib",
    "LD_PRELOAD": "/usr/lib/libjemalloc.so",
    "HOME": "/scratch/me",
    "TMPDIR": "/scratch/tmp",
    "OMP_NUM_THREADS": "8",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}
# Credentials in the value, whatever the name.
SECRET_VALUES = [
    "https://user:secret@host.example/simple",
    "postgres://app:pa55@db:5432/prod",
    "see hf_" + "A1b2" * 9,
    "ghp_" + "x" * 36,
    "github_pat_" + "y" * 40,
    "sk-" + "z" * 40,
    "AKIA" + "ABCDEFGHIJKLMNOP",
]
# Names the script, Slurm, torchrun or the shell own: the ones the issue names, and one of each kind.
RESERVED = [
    "RUN_DIR", "SWITCHES", "IFS", "SLURM_JOB_ID", "JOBGEN_RUN_DIR", "JOBGEN_LOCAL", "SLURMD_NODENAME",
    "SBATCH_PARTITION", "SRUN_CPUS_PER_TASK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "PATH", "PYTHONPATH", "BASH_ENV", "ENV", "PS4", "SHELLOPTS", "BASHOPTS", "TMOUT",
    "PROMPT_COMMAND", "CUDA_VISIBLE_DEVICES", "status", "NODE_LAUNCH", "TASK_RECORD", "PLANNED_EXIT_CODES", "PMIX_RANK",
]  # fmt: skip


def doctor(tmp_path: Path, env: dict[str, str], site: str | dict[str, object] = "local") -> Path:
    return run_spec(tmp_path, "e", site=site, job={"program": "doctor", "time": "10m"}, env=env)


@pytest.mark.parametrize("name", MUST_REFUSE)
def test_a_credentials_name_is_refused_however_it_is_spelled(tmp_path: Path, name: str):
    found = spec_issues(doctor(tmp_path, {name: "literal-value-123"}))
    assert f"{name} looks like a secret" in found.get("env", ""), found
    assert f"job.pass_env = [{name!r}]" in found["env"]


def test_settings_and_plain_words_are_allowed(tmp_path: Path):
    spec = load_run(doctor(tmp_path, MUST_ALLOW))
    assert spec.run.env == MUST_ALLOW


@pytest.mark.parametrize("value", SECRET_VALUES)
def test_a_credential_in_the_value_is_refused_whatever_the_name(tmp_path: Path, value: str):
    found = spec_issues(doctor(tmp_path, {"PIP_EXTRA_INDEX": value}))
    assert "PIP_EXTRA_INDEX has a" in found.get("env", "") and "in its value" in found["env"], found


def test_the_site_and_its_network_tables_get_the_same_check(tmp_path: Path):
    site = {"profile": "local", "env": {"WANDBKEY": "k"}, "network": {"env": {"NCCL_X": "https://a:b@c"}}}
    found = spec_issues(doctor(tmp_path, {}, site=site))
    assert "WANDBKEY looks like a secret" in found.get("site.env", ""), found
    assert "NCCL_X has a password in a URL" in found.get("site.network.env", ""), found


@pytest.mark.parametrize("name", RESERVED)
def test_a_name_the_script_slurm_torchrun_or_the_shell_owns_is_refused_with_its_key(tmp_path: Path, name: str):
    found = spec_issues(doctor(tmp_path, {name: "/elsewhere", "OMP_NUM_THREADS": "2"}))
    key = f"env.{name} (the name)"
    assert key in found and found[key].startswith(name), found
    assert set(found) == {key}  # the allowed neighbour is fine


def test_reserved_names_are_refused_in_the_site_tables_too(tmp_path: Path):
    site = {"profile": "local", "env": {"SLURM_JOB_ID": "1"}, "network": {"env": {"RUN_DIR": "/x"}}}
    found = spec_issues(doctor(tmp_path, {}, site=site))
    assert "Slurm sets it" in found.get("site.env.SLURM_JOB_ID (the name)", ""), found
    assert "batch script itself" in found.get("site.network.env.RUN_DIR (the name)", ""), found


def test_a_refused_name_does_not_hide_a_secret_beside_it(tmp_path: Path):
    found = spec_issues(doctor(tmp_path, {"RUN_DIR": "/elsewhere", "HFTOKEN": "abc"}))
    assert "env.RUN_DIR (the name)" in found and "HFTOKEN looks like a secret" in found.get("env", ""), found


def test_path_and_pythonpath_are_refused_with_advice(tmp_path: Path):
    found = spec_issues(doctor(tmp_path, {"PATH": "/opt/bin", "PYTHONPATH": "/src"}))
    assert "[python]" in found["env.PATH (the name)"]
    assert "venv" in found["env.PYTHONPATH (the name)"] and "command.workdir" in found["env.PYTHONPATH (the name)"]


def test_secret_problem_is_none_for_every_allowed_setting():
    assert all(secret_problem(name, value) is None for name, value in MUST_ALLOW.items())
    assert all(reserved_problem(name) is None for name in MUST_ALLOW)


# ---------------------------------------------------------------- the scripts' own variables

_JINJA = re.compile(r"\{#.*?#\}|\{%.*?%\}", re.DOTALL)
_STATEMENT = r"(?:^|[;&|({!]|\b(?:then|do|else|if|elif|while|until))\s*"
_ASSIGN = re.compile(_STATEMENT + r"([A-Za-z_]\w*)(?:\[[^\]]*\])?\+?=")
_DECLARE = re.compile(_STATEMENT + r"(local|export|declare|readonly|unset)((?:\s+-\w+)*)\s+([^;&|<>)]*)")
_FOR = re.compile(r"\bfor\s+([A-Za-z_]\w*)\s+in\b")
_READ = re.compile(r"\bread\s+([^;&|<>}]*)")
_HEREDOC_PY = re.compile(r"<<'PY'\n.*?\nPY\n", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z_]\w*$")


def _read_names(words: list[str]) -> list[str]:
    """The variables of ``read [options] NAME...``."""
    names, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word[-1] in "adinNptu" and word not in ("-r", "-s", "-e")
        elif _NAME.match(word):
            names.append(word)
    return names


def _words(text: str) -> list[str]:
    try:
        return shlex.split(text, posix=True)
    except ValueError:  # a quote the segment cut off
        return text.split()


def assigned_variables(text: str) -> set[str]:
    """Every variable a bash script (or a template of one, its Jinja taken out) assigns,
    exports, declares, reads into, loops over or unsets."""
    text = _HEREDOC_PY.sub("", _JINJA.sub("", text))
    text = re.sub(r"\{\{.*?\}\}", '"@"', text)  # a printed value: never a name
    found: set[str] = set()
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        found |= set(_ASSIGN.findall(line)) | set(_FOR.findall(line))
        for _, options, rest in _DECLARE.findall(line):
            if "f" not in options:  # declare -f prints functions
                found |= {w.split("=", 1)[0] for w in _words(rest) if _NAME.match(w.split("=", 1)[0])}
        for rest in _READ.findall(line):
            found |= set(_read_names(_words(rest)))
    return found


def test_the_scanner_finds_each_kind_of_assignment():
    text = (
        "A=1\nexport B=2 C\nlocal d=3 e\nif f=$(x); then g=1; fi\n{ read -r h && read -r -d '' i; } <x\n"
        'for j in 1; do :; done\nk+=(1)\n[[ x ]] || l=2\nscontrol update JobId=1 Comment=x\nNODE="$(declare -f m)"\n'
        "# n=1 in a comment\nunset O\nexport {{ name|trusted }}={{ value }}\nexport P='a  b'\n"
    )
    assert assigned_variables(text) == {"A", "B", "C", "d", "e", "f", "g", "h", "i", "j", "k", "l", "NODE", "O", "P"}


def test_every_variable_the_templates_assign_is_refused_or_a_documented_default():
    assigned = set().union(*(assigned_variables(p.read_text()) for p in TEMPLATES.glob("*.j2")))
    assert {"RUN_DIR", "SWITCHES", "status", "NODE_LAUNCH", "SWEEP_DIR", "SERVE_PID"} <= assigned  # it reads them
    unlisted = sorted(n for n in assigned if n not in SCRIPT_DEFAULTS and reserved_problem(n) is None)
    assert not unlisted, f"variables of sbatch_templates/ that [env] could override: {unlisted}"
    # And the other way: every name on the lists is one a template still sets.
    stale = sorted((SCRIPT_OWNED | SCRIPT_DEFAULTS) - assigned)
    assert not stale, f"names in jobgen.spec.env_names that no template assigns any more: {stale}"


def spec_exports(golden: Path) -> set[str]:
    """The names a golden script's spec exports itself ([env], the site's env tables, HF_HOME)."""
    stem = golden.stem.removeprefix("serve-")
    spec_file = next(p for d in ("specs", "serve-specs") if (p := GOLDEN / d / f"{stem}.toml").exists())
    spec = load_run(spec_file)
    return {*spec.run.env, *spec.site.env, *spec.site.network.env, "HF_HOME"}


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("*.sbatch")), ids=lambda p: p.stem)
def test_every_variable_a_rendered_script_assigns_is_covered(golden: Path):
    assigned = assigned_variables(golden.read_text()) - spec_exports(golden)
    assert "RUN_DIR" in assigned
    assert not sorted(n for n in assigned if n not in SCRIPT_DEFAULTS and reserved_problem(n) is None)


def test_a_default_the_run_overrides_is_exported_after_the_scripts_own(tmp_path: Path):
    text = render(load_run(doctor(tmp_path, {"OMP_NUM_THREADS": "7", "NCCL_DEBUG": "WARN"})))
    assert text.index("export OMP_NUM_THREADS=7") > text.index("export OMP_NUM_THREADS=")
    assert "export NCCL_DEBUG=WARN" in text
