"""The ``[serve]`` table of ``run.toml``: how ``jobgen serve`` runs an OpenAI-compatible
server for the run's exported model as a Slurm job.

    [serve]
    engine = "auto"        # vLLM where it is installed and the job has a GPU, else transformers
    time = "4h"            # the serve job's time limit
    port = 0               # 0: a free port on the node, chosen when the server starts

The server is a well-kept one, not jobgen's: ``transformers serve`` (CPU or GPU) or
``vllm serve`` (GPU sites). It listens on one address of its node: a wildcard (every
interface) or a public address only with ``expose = true``, which needs an API key
(``api_key_env``, the name of a variable whose value is never written). Addresses are read as
the OS reads them (:func:`numeric_address`), and names are resolved on the node
(jobgen.serve.node), where the same check runs again. Descriptions are the reference
documentation (``jobgen schema``).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from jobgen.spec.env_names import secret_name
from jobgen.spec.fields import Duration, EnvName, EnvValue, SlurmMemory, SlurmName, SpecModel, matching

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# The engine options that say where the server listens and who may ask it: jobgen sets them
# (serve.host, serve.port, serve.api_key_env), so serve.args may not, in any spelling the
# engines take. Each maps to what to use instead.
OWNED_OPTIONS = {
    "--host": "serve.host (serve.expose for every interface)",
    "--port": "serve.port",
    "--uds": "serve.host",
    "--api-key": (
        "serve.api_key_env, the NAME of a variable exported in the submitting shell (a key written in the spec "
        "would be copied in plain text into the run directory)"
    ),
}
# The shortest API key the server takes: guessing it over the network must be hopeless.
MIN_API_KEY_LENGTH = 16


def numeric_address(host: str) -> IPAddress | None:
    """``host`` read as the OS reads an address literal, or None for a host name. The C library
    decides, not a string comparison: '0', '00', '0x0' and '0.0' are 0.0.0.0 to inet_aton,
    '::0' and '0:0:0:0:0:0:0:0' are '::'. No name is looked up (AI_NUMERICHOST)."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        found = socket.getaddrinfo(text, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        return None
    return ipaddress.ip_address(str(found[0][4][0]).split("%")[0])


def exposure(address: IPAddress) -> str | None:
    """What listening on ``address`` opens the server to, when that is more than the cluster's
    own networks: every interface (a wildcard), or the internet (a globally routable address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # '::ffff:0.0.0.0' binds as 0.0.0.0 does
    if address.is_unspecified:
        return "every interface of the node"
    if address.is_global:
        return "a public (globally routable) address"
    return None


def exposure_refusal(host: str, address: IPAddress, what: str) -> str:
    """The one-line refusal of a wildcard or public address without serve.expose."""
    shown = host if host == str(address) else f"{host} ({address})"
    return (
        f"'{shown}' is {what}: the model server would answer anyone who can reach the node. Leave serve.host out "
        "(the node's address on the site's network.ifname), name one address of the cluster's network, or set "
        "serve.expose = true with serve.api_key_env to share it knowingly"
    )


def _owned_option(arg: str) -> str:
    """Refuse an engine argument that sets what jobgen sets: '--host', '--host=...', vLLM's
    '--api_key' (it reads '_' as '-') and any prefix argparse would take for one ('--ho')."""
    if arg.startswith("--"):
        name = arg.split("=", 1)[0].replace("_", "-")
        for option, instead in OWNED_OPTIONS.items():
            if len(name) > 2 and option.startswith(name):
                raise ValueError(f"'{arg}' is the engine's {option}, which jobgen sets: use {instead}")
    return arg


def _secret_name(name: str) -> str:
    """The key's variable must be one jobgen never records by value (repro/env.txt)."""
    if not secret_name(name):
        raise ValueError(
            f"'{name}' does not look like a secret's name: a run's repro/env.txt may record its value. Name it "
            "as credentials are named (jobgen.spec.env_names), e.g. SERVE_API_KEY"
        )
    return name


# An IPv4 or IPv6 address or a host name, as the server's --host takes it. Wildcard and public
# addresses need serve.expose (ServeSpec._host_exposure); a name is resolved on the node.
ServeHost = matching(
    r"^[A-Za-z0-9_.:\[\]-]{1,253}$",
    "an address or a host name",
    "an IPv4 or IPv6 address or a host name: letters, digits and '_.:[]-', at most 253 characters",
    chars=r"[A-Za-z0-9_.:\[\]-]",
)
# One argument of the engine's serve command.
EngineArg = Annotated[EnvValue, AfterValidator(_owned_option)]
# The name of the variable that holds the API key.
ApiKeyName = Annotated[EnvName, AfterValidator(_secret_name)]
# The name clients send as "model": one or two path-like words ('tiny-sft', 'team/llama-sft').
# transformers serve reads a name with ':...gguf' or '@revision' as something else, so neither is allowed.
ModelName = matching(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?$",
    "a model name",
    "one or two words joined by '/', each of letters, digits and '._-' starting with a letter or digit, at most 128",
    chars=r"[A-Za-z0-9._/-]",
)


class ServeSpec(SpecModel):
    """``jobgen serve RUN``: an OpenAI-compatible server for an export of the run's checkpoint, as a
    one-node Slurm job with the run's site profile and [env]."""

    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto",
        description=(
            "The server: 'transformers' (`transformers serve`, CPU or GPU; the [serve] extra), 'vllm' "
            "(`vllm serve`, GPU sites; install the vLLM build that matches the site's CUDA), or 'auto': vLLM when "
            "it is installed on the node and the job has a GPU, else transformers. Decided on the node, as the "
            "job starts; serve.json and `jobgen serve RUN --status` name the engine used."
        ),
    )
    time: Duration = Field(
        "4h",
        description=(
            "Time limit of the serve job, e.g. '30m', '08:00:00'. At the limit Slurm stops the server; its "
            "address file goes and no process is left. `jobgen serve RUN --time` overrides it for one job."
        ),
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port to listen on; 0 picks a free one on the node when the server starts (the default).",
    )
    api_key_env: ApiKeyName | None = Field(
        None,
        description=(
            "The NAME of an environment variable, e.g. 'SERVE_API_KEY', whose value clients must send as their API "
            f"key (`Authorization: Bearer ...`; the `openai` client's api_key). Export it in the shell you run "
            "`jobgen serve` from: Slurm passes it to the job, and jobgen never writes its value (serve.sbatch, "
            "serve.json and the logs hold the name only). The engine then listens on a socket only you can open, "
            "behind jobgen's proxy that asks for the key on every path (`transformers serve` has no key, vLLM's "
            "covers only some paths); vLLM also gets it as VLLM_API_KEY. `jobgen chat` reads the same variable. "
            "The value must be set, printable and at "
            f"least {MIN_API_KEY_LENGTH} characters long (e.g. `export SERVE_API_KEY=$(openssl rand -hex 24)`)."
        ),
    )
    expose: bool = Field(
        False,
        description=(
            "Allow serve.host to be a wildcard ('0.0.0.0', '::', in any spelling: every interface of the node) "
            "or a public, globally routable address, and the node's address on network.ifname to be one. The "
            "server then answers anyone who can reach the node, inside the cluster or beyond it: a choice to make "
            "knowingly. Needs serve.api_key_env: jobgen never opens a server without a key beyond the cluster's "
            "own network."
        ),
    )
    host: ServeHost | None = Field(
        None,
        description=(
            "Address to listen on. Default: the node's IPv4 address on the site's network.ifname (the address "
            "its hostname resolves to on sites without one; 127.0.0.1 with --local). A wildcard (every "
            "interface: '0.0.0.0', '0', '0x0', '::', ...) or a public address is refused unless serve.expose. "
            "A host name is resolved on the node as the job starts, and refused there if any of its addresses "
            "is one of those; the server listens on the address it resolved to."
        ),
    )
    model_name: ModelName | None = Field(
        None,
        description=(
            "The name clients send as 'model' (and /v1/models lists). Default: the run's job.name, or the "
            "directory's name for `jobgen serve DIR`."
        ),
    )
    partition: SlurmName | None = Field(
        None, description="Partition of the serve job; default the run's job.partition, else the site's."
    )
    gpus: int | None = Field(
        None,
        ge=0,
        le=64,
        description=(
            "GPUs of the serve job (vLLM's --tensor-parallel-size). Default: 1 on GPU sites, 0 on CPU sites. "
            "At most the site's slurm.gpus_per_node."
        ),
    )
    cpus: int | None = Field(
        None, ge=1, le=1024, description="CPUs of the serve job (--cpus-per-task); default the site's cpus_per_node."
    )
    mem: SlurmMemory | None = Field(
        None, description="Memory of the serve job (--mem), e.g. '64G'; default the site's."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights' dtype in the server; 'auto' keeps the exported model's (the run's model.dtype)."
    )
    ready_timeout: Duration = Field(
        "15m",
        description=(
            "How long the server may take to load the model and answer; the job fails (and says so in its log) "
            "if it has not answered by then."
        ),
    )
    args: list[EngineArg] = Field(
        default_factory=list,
        description=(
            "Extra arguments for the engine's serve command, each passed as one argument, e.g. "
            "['--max-model-len', '8192'] for vllm or ['--continuous-batching'] for transformers. Needs "
            "engine = 'transformers' or 'vllm': the two take different options. Where the server listens and "
            "its key are jobgen's: --host, --port, --uds and --api-key (in any spelling) are refused here."
        ),
    )

    @field_validator("port")
    @classmethod
    def _unprivileged(cls, port: int) -> int:
        if 0 < port < 1024:
            raise ValueError(f"port {port} is privileged (below 1024): choose 1024-65535, or 0 for a free one")
        return port

    @field_validator("expose")
    @classmethod
    def _exposed_with_a_key(cls, expose: bool, info: ValidationInfo) -> bool:
        if expose and not info.data.get("api_key_env"):
            raise ValueError(
                "serve.expose = true needs serve.api_key_env: a server open beyond the cluster's network must ask "
                "for a key"
            )
        return expose

    @field_validator("host")
    @classmethod
    def _host_exposure(cls, host: str | None, info: ValidationInfo) -> str | None:
        address = None if host is None else numeric_address(host)
        what = None if address is None else exposure(address)
        if what and not info.data.get("expose"):
            raise ValueError(exposure_refusal(host, address, what))
        return host

    @model_validator(mode="after")
    def _args_need_an_engine(self) -> ServeSpec:
        if self.args and self.engine == "auto":
            raise ValueError(
                "serve.args are options of one engine's serve command: set serve.engine = 'transformers' or "
                "'vllm' with them (engine 'auto' may pick either)"
            )
        return self
