"""The ``[serve]`` table of ``run.toml``: how ``jobgen serve`` runs an OpenAI-compatible
server for the run's exported model as a Slurm job.

    [serve]
    engine = "auto"        # vLLM where it is installed and the job has a GPU, else transformers
    time = "4h"            # the serve job's time limit
    port = 0               # 0: a free port on the node, chosen when the server starts

The server is a well-kept one, not jobgen's: ``transformers serve`` (CPU or GPU) or
``vllm serve`` (GPU sites). It listens on one address of its node, never on every
interface: the endpoint has no authentication. Descriptions are the reference
documentation (``jobgen schema``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints, field_validator, model_validator

from jobgen.fields import Duration, EnvValue, SlurmMemory, SlurmName, StrictModel

# Addresses that mean "every interface": an unauthenticated endpoint there is open to every
# network the node is on, including ones that are none of the cluster's.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "*", "0"})


def _not_wildcard(host: str) -> str:
    if host in WILDCARD_HOSTS:
        raise ValueError(
            f"'{host}' listens on every interface of the node, and the server has no authentication; "
            "leave serve.host out (the node's address on the site's network.ifname) or name one address"
        )
    return host


# An IPv4 or IPv6 address or a host name, as the server's --host takes it.
ServeHost = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:\[\]-]{1,253}$"), AfterValidator(_not_wildcard)]
# The name clients send as "model": one or two path-like words ('tiny-sft', 'team/llama-sft').
# transformers serve reads a name with ':...gguf' or '@revision' as something else, so neither is allowed.
ModelName = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?$")
]


class ServeSpec(StrictModel):
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
    host: ServeHost | None = Field(
        None,
        description=(
            "Address to listen on. Default: the node's IPv4 address on the site's network.ifname (the address "
            "its hostname resolves to on sites without one; 127.0.0.1 with --local). A wildcard such as "
            "'0.0.0.0' is refused: the server has no authentication."
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
    args: list[EnvValue] = Field(
        default_factory=list,
        description=(
            "Extra arguments for the engine's serve command, each passed as one argument, e.g. "
            "['--max-model-len', '8192'] for vllm or ['--continuous-batching'] for transformers. Needs "
            "engine = 'transformers' or 'vllm': the two take different options."
        ),
    )

    @field_validator("port")
    @classmethod
    def _unprivileged(cls, port: int) -> int:
        if 0 < port < 1024:
            raise ValueError(f"port {port} is privileged (below 1024): choose 1024-65535, or 0 for a free one")
        return port

    @model_validator(mode="after")
    def _args_need_an_engine(self) -> ServeSpec:
        if self.args and self.engine == "auto":
            raise ValueError(
                "serve.args are options of one engine's serve command: set serve.engine = 'transformers' or "
                "'vllm' with them (engine 'auto' may pick either)"
            )
        return self
