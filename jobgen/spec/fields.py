"""Constrained field types shared by the site and run models.

Anything that ends up in an ``#SBATCH`` line or on a command line is either a
validated token (these types) or shell-quoted at render time. The patterns are
deliberately narrow: a partition name with a ``;`` in it is a typo or an attack,
and either way the right answer is an error that names the key.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
)

from jobgen.base.durations import format_human, parse_duration
from jobgen.spec.env_names import reserved_problem, secret_problem


class StrictModel(BaseModel):
    """Base for every spec table: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class SpecModel(StrictModel):
    """Base for the tables of run.toml and of a site profile: strict types as well, so that
    ``nodes = true`` is an error instead of 1 and ``nodes = "4"`` one instead of 4 (TOML and
    spec.json give every value its own type; only a mistake gives another)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True)


def _char_names(chars: list[str]) -> str:
    named = {" ": "a space", "\t": "a tab", "'": "a quote (')", '"': 'a double quote (")'}
    return ", ".join(named.get(c, repr(c) if c.isprintable() else f"{c!r} (a control character)") for c in chars)


def matching(pattern: str, what: str, rule: str, *, chars: str | None = None) -> Any:
    """A string type that must match ``pattern``, whose error says in words what is wrong
    (pydantic's own message prints the regular expression): the characters that may not
    stand there (``chars``: the class of those that may), else ``rule``. The JSON schema
    keeps the pattern, for editors."""
    whole = re.compile(pattern)
    allowed = re.compile(chars) if chars else None

    def check(value: str) -> str:
        if whole.fullmatch(value):
            return value
        if not value:
            raise ValueError(f"an empty value is not {what}: {rule}")
        bad = sorted({c for c in value if allowed is not None and not allowed.fullmatch(c)})
        if bad:
            raise ValueError(f"{value!r} is not {what}: {_char_names(bad)} cannot be used; {rule}")
        raise ValueError(f"{value!r} is not {what}: {rule}")

    return Annotated[str, AfterValidator(check), WithJsonSchema({"type": "string", "pattern": pattern})]


# Stored as whole seconds; serialised back to human syntax so a resolved spec written
# as JSON loads again through the same validator.
Duration = Annotated[
    int,
    BeforeValidator(parse_duration),
    PlainSerializer(format_human, return_type=str),
    WithJsonSchema(
        {
            "type": "string",
            "description": "Slurm ('04:00:00', '2-00:00:00') or human ('90s', '10m', '1h30m') syntax",
            "examples": ["30m", "04:00:00", "2-00:00:00"],
        }
    ),
]

# Job names end up in file names (%x) and squeue output.
JobName = matching(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
    "a job name",
    "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64 characters",
    chars=r"[A-Za-z0-9._-]",
)
# Partition, account, QOS, reservation and node names as Slurm allows them.
SlurmName = matching(
    r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$",
    "a Slurm name",
    "letters, digits, '_', '.' and '-', not starting with '.' or '-', at most 128 characters",
    chars=r"[A-Za-z0-9_.-]",
)
# Node lists may use Slurm's bracket syntax: node[1-4,7].
HostList = matching(
    r"^[A-Za-z0-9_.\-\[\],]{1,1024}$",
    "a node list",
    "node names as Slurm writes them, e.g. 'gpu017' or 'gpu[20-22]', at most 1024 characters",
    chars=r"[A-Za-z0-9_.\-\[\],]",
)
# Slurm feature expressions: a100&ib, [rack1|rack2], gpu*2.
Constraint = matching(
    r"^[A-Za-z0-9_.&|\[\]()*:,!-]{1,256}$",
    "a Slurm feature expression",
    "letters, digits and _ . & | [ ] ( ) * : , ! -, e.g. 'a100&ib', at most 256 characters",
    chars=r"[A-Za-z0-9_.&|\[\]()*:,!-]",
)
# Filesystem paths as typed in a spec or site file: no whitespace, quotes, globs, '%'
# (Slurm filename pattern) or shell metacharacters. This checks the text only: the
# directory a relative path is joined to can hold anything, so render quotes #SBATCH
# values and escapes %-patterns regardless, and loader._check_run_dir checks the result.
SafePath = matching(
    r"^[A-Za-z0-9_./~+@:=,-]{1,4096}$",
    "a path jobgen can write into a batch script",
    "letters, digits and _ . / ~ + @ : = , - only (no spaces, quotes, '%', '$' or other shell characters); "
    "a directory with such a name can be reached through a link whose path has none",
    chars=r"[A-Za-z0-9_./~+@:=,-]",
)
# Network interface names as Linux allows them (IFNAMSIZ is 16 with the NUL).
InterfaceName = matching(
    r"^[A-Za-z0-9_.:-]{1,15}$",
    "a network interface name",
    "letters, digits, '_', '.', ':' and '-', at most 15 characters, e.g. 'ib0' or 'eth0'",
    chars=r"[A-Za-z0-9_.:-]",
)
EnvName = matching(
    r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
    "an environment variable name",
    "letters, digits and '_', not starting with a digit, at most 128 characters",
    chars=r"[A-Za-z0-9_]",
)
# Environment module names (Lmod): gcc/12.2, cuda/12.4.1, nccl-ofi.
ModuleName = matching(
    r"^[A-Za-z0-9_.+/@-]{1,256}$",
    "an environment module name",
    "letters, digits and _ . + / @ -, e.g. 'cuda/12.4.1', at most 256 characters",
    chars=r"[A-Za-z0-9_.+/@-]",
)
# Memory as Slurm's --mem takes it: 0 (all of the node), 64G, 500000M.
SlurmMemory = matching(
    r"^\d+[KMGT]?$",
    "a Slurm memory size",
    "a whole number with an optional unit K, M, G or T, e.g. '480G'; '0' for all",
)

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def no_control_chars(value: str) -> str:
    """Env values may contain anything printable (they are shell-quoted), but a NUL or a
    newline in an environment variable is almost always a copy-paste accident."""
    if _CONTROL.search(value):
        raise ValueError("control characters (newline, NUL, ...) are not allowed")
    return value


EnvValue = Annotated[str, BeforeValidator(lambda v: no_control_chars(v) if isinstance(v, str) else v)]

# '--name' or '--name=value'; the value is free text (render quotes it for sbatch).
_SBATCH_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=.*)?", re.DOTALL)


def sbatch_option(value: str) -> str:
    """One extra #SBATCH option. Checked entry by entry so an error names its index; a space
    in the option's name means two options in one entry ('--gres gpu:1'), which sbatch
    would get as one unknown option."""
    if not _SBATCH_OPTION.fullmatch(value):
        raise ValueError(
            f"{value!r} is not one long option, '--name' or '--name=value' (e.g. '--gpu-bind=none'); "
            "give each option its own entry"
        )
    return no_control_chars(value)


SbatchOption = Annotated[str, AfterValidator(sbatch_option)]


def _not_reserved(name: str) -> str:
    problem = reserved_problem(name)
    if problem:
        raise ValueError(problem)
    return name


def _literal_secrets(env: object) -> str | None:
    """Why the table holds a credential's value, or None. Written in a spec or site file, it
    would be copied in plain text into the run directory (run.toml, spec.json, the batch
    script), which the group may read. jobgen.spec.env_names.secret_problem is the one rule, the
    job's env.txt uses it too."""
    if not isinstance(env, dict):
        return None
    texts = {n: v for n, v in env.items() if isinstance(n, str) and isinstance(v, str)}
    problems = {name: secret_problem(name, value) for name, value in texts.items()}
    secrets = sorted(name for name, problem in problems.items() if problem)
    if not secrets:
        return None
    why = "; ".join(f"{name} {problems[name]}" for name in secrets)
    return (
        f"{why}: the value would be written in plain text into the run directory "
        f"(run.toml, spec.json, the batch script). Export it in the shell you submit from and list it in "
        f"job.pass_env = {secrets!r}: sbatch passes it to the job and jobgen never writes it"
    )


def _env_table(env: object, handler: ValidatorFunctionWrapHandler) -> dict[str, str]:
    """The table's names and values checked one by one, and its credentials: all of it
    reported at once (a refused name does not hide a secret beside it)."""
    secrets = _literal_secrets(env)
    try:
        checked = handler(env)
    except ValidationError as exc:
        if secrets is None:
            raise
        secret_error = {"type": "value_error", "loc": (), "input": env, "ctx": {"error": ValueError(secrets)}}
        raise ValidationError.from_exception_data(exc.title, [*exc.errors(), secret_error]) from None
    if secrets is not None:
        raise ValueError(secrets)
    return checked


# A name [env] may set: not one the batch script, Slurm, torchrun or the shell owns
# (jobgen.spec.env_names.reserved_problem); the error names the key.
EnvKey = Annotated[EnvName, AfterValidator(_not_reserved)]
# The variables a spec or site exports in the job: names as the shell allows them and no one
# else owns, values printable, and no credential given as a literal value.
JobEnv = Annotated[dict[EnvKey, EnvValue], WrapValidator(_env_table)]
