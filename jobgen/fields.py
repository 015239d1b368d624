"""Constrained field types shared by the site and run models.

Anything that ends up in an ``#SBATCH`` line or on a command line is either a
validated token (these types) or shell-quoted at render time. The patterns are
deliberately narrow: a partition name with a ``;`` in it is a typo or an attack,
and either way the right answer is an error that names the key.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    StringConstraints,
    WithJsonSchema,
)

from jobgen.durations import format_human, parse_duration


class StrictModel(BaseModel):
    """Base for every spec table: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


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
JobName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
# Partition, account, QOS, reservation and node names as Slurm allows them.
SlurmName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")]
# Node lists may use Slurm's bracket syntax: node[1-4,7].
HostList = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-\[\],]{1,1024}$")]
# Slurm feature expressions: a100&ib, [rack1|rack2], gpu*2.
Constraint = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.&|\[\]()*:,!-]{1,256}$")]
# Filesystem paths as typed in a spec or site file: no whitespace, quotes, globs, '%'
# (Slurm filename pattern) or shell metacharacters. This checks the text only: the
# directory a relative path is joined to can hold anything, so render quotes #SBATCH
# values and escapes %-patterns regardless, and loader._check_run_dir checks the result.
SafePath = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_./~+@:=,-]{1,4096}$")]
# Network interface names as Linux allows them (IFNAMSIZ is 16 with the NUL).
InterfaceName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,15}$")]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
# Environment module names (Lmod): gcc/12.2, cuda/12.4.1, nccl-ofi.
ModuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.+/@-]{1,256}$")]
# Memory as Slurm's --mem takes it: 0 (all of the node), 64G, 500000M.
SlurmMemory = Annotated[str, StringConstraints(pattern=r"^\d+[KMGT]?$")]

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

# Words of a variable's name (split at '_') that make it a credential: HF_TOKEN, WANDB_API_KEY,
# MY_PASSWORD, AWS_SECRET_ACCESS_KEY. Whole words, so TOKENIZERS_PARALLELISM is not one
# (jobgen.repro's deny list for env.txt matches substrings instead: hiding too much there
# costs nothing, refusing a harmless setting here would).
SECRET_WORDS = frozenset(
    {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASS", "PASSPHRASE", "KEY", "APIKEY", "CREDENTIAL", "CREDENTIALS"}
    | {"AUTH", "PRIVATE", "COOKIE", "WEBHOOK"}
)


def looks_secret(name: str) -> bool:
    return any(word in SECRET_WORDS for word in name.upper().split("_"))


def _refuse_literal_secrets(env: dict[str, str]) -> dict[str, str]:
    """A credential's value written in a spec or site file would be copied in plain text into
    the run directory (run.toml, spec.json, the batch script), which the group may read."""
    secrets = sorted(name for name in env if looks_secret(name))
    if secrets:
        names = ", ".join(secrets)
        raise ValueError(
            f"{names} looks like a secret: its value would be written in plain text into the run directory "
            f"(run.toml, spec.json, the batch script). Export it in the shell you submit from and list it in "
            f"job.pass_env = {secrets!r}: sbatch passes it to the job and jobgen never writes it"
        )
    return env


# The variables a spec or site exports in the job: names as the shell allows them, values
# printable, and no credential given as a literal value.
JobEnv = Annotated[dict[EnvName, EnvValue], AfterValidator(_refuse_literal_secrets)]
