"""Site profile: everything that belongs to the cluster rather than to one job.

A profile lives in ``<name>.toml`` (``jobgen site init`` writes
``~/.config/jobgen/sites/<name>.toml``; jobgen ships some in ``jobgen/bundled/site_configs/``),
or any path, and is chosen by the run's top-level ``site`` key. The run may override any key of it, e.g.::

    [site]
    profile = "h100-ib"
    network.debug = true

The field descriptions below are the reference documentation (``jobgen schema``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from jobgen.spec import containers
from jobgen.spec.fields import (
    Constraint,
    EnvValue,
    HostList,
    InterfaceName,
    JobEnv,
    ModuleName,
    SafePath,
    SbatchOption,
    SlurmMemory,
    SlurmName,
    SpecModel,
    matching,
)
from jobgen.spec.tables.watchdogs import WatchdogSettings


def _check_size(value: str) -> str:
    from jobgen.base.sizes import parse_size

    if parse_size(value) <= 0:
        raise ValueError(f"{value!r} must be more than zero bytes")
    return value


# A human memory size, kept as written ('80GiB', '24G', '500MiB'); jobgen.base.sizes parses it.
DeviceMemory = Annotated[
    matching(
        r"^\s*\d+(\.\d+)?\s*[KMGTPkmgtp]?(i?[Bb])?\s*$",
        "a memory size",
        "a number with an optional unit, e.g. '80GiB', '23.5GiB', '24G' or '500MB'",
    ),
    AfterValidator(_check_size),
]
GresName = matching(
    r"^[A-Za-z0-9_]+(:[A-Za-z0-9_.-]+)?$", "a gres name", "a name, optionally typed: 'gpu' or 'gpu:h100'"
)
IbHca = matching(
    r"^[A-Za-z0-9_.:,=^-]{1,256}$",
    "an NCCL_IB_HCA value",
    "letters, digits and _ . : , = ^ -, e.g. 'mlx5_0,mlx5_1' or '=mlx5_0:1', at most 256 characters",
    chars=r"[A-Za-z0-9_.:,=^-]",
)
ContainerImage = matching(
    r"^[A-Za-z0-9_./:@+#-]{1,512}$",
    "a container image",
    "letters, digits and _ . / : @ + # -, e.g. 'nvcr.io#nvidia/pytorch:24.05-py3', at most 512 characters",
    chars=r"[A-Za-z0-9_./:@+#-]",
)
ContainerRuntimeName = Literal["pyxis", "apptainer", "podman"]
# One word of the runtime's command line: an option, with its value after '=' (words go to srun or
# the runtime quoted, but a site's option is no place for spaces or shell syntax either).
ContainerOption = matching(
    r"^--?[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_./:+@,=-]{1,256})?$",
    "a container runtime option",
    "one option with its value after '=', e.g. '--device=/dev/infiniband' or '--writable-tmpfs'",
    chars=r"[A-Za-z0-9_./:+@,=-]",
)
SiteName = matching(
    r"^[A-Za-z0-9_.-]{1,64}$",
    "a site name",
    "letters, digits, '_', '.' and '-', at most 64 characters",
    chars=r"[A-Za-z0-9_.-]",
)


# Relaunches inside one array task: a few ride out a flaky rank; more only hide a broken run.
MAX_IN_JOB_RESTARTS = 20
# slurm.in_job_restarts unset: on sites whose ranks compute on GPUs (where a task's nodes are
# hard to get back), this many; elsewhere none, so the task-to-task path stays the tested one.
GPU_SITE_IN_JOB_RESTARTS = 2


class NodeShape(SpecModel):
    """Nodes of the partition alike in what a job can ask of them, as Slurm describes them
    (``jobgen site init`` writes one entry per distinct shape)."""

    nodes: HostList = Field(description="The nodes of this shape, as Slurm names them: 'node1,node2' or 'gpu[01-16]'.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs (gres gpu) on each of these nodes.")
    cpus: int = Field(ge=1, le=4096, description="CPUs a job may use on each of these nodes (Slurm's CPUEfctv).")
    memory: SlurmMemory | None = Field(
        None, description="Memory of each of these nodes (Slurm's RealMemory), e.g. '4096M'."
    )


class SlurmSettings(SpecModel):
    """How jobs ask Slurm for resources on this cluster."""

    partition: SlurmName | None = Field(
        None, description="Partition for training jobs; empty means the cluster's default partition."
    )
    account: SlurmName | None = Field(None, description="Account (--account) to charge; empty for none.")
    qos: SlurmName | None = Field(None, description="Quality of service (--qos); empty for none.")
    constraint: Constraint | None = Field(None, description="Node feature expression (--constraint), e.g. 'h100&ib'.")
    reservation: SlurmName | None = Field(None, description="Reservation (--reservation) to run in.")
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs per node; 0 for a CPU-only site (gloo backend).")
    device_memory: DeviceMemory | None = Field(
        None,
        description=(
            "Memory one rank may use, for `jobgen plan` and submit's memory check: on GPU sites the memory "
            "of one GPU (e.g. '79GiB' for an H100 80GB, '23.5GiB' for an RTX 4090), on CPU sites the host "
            "memory of one process (default there: slurm.mem / procs_per_node, by its largest entry for a "
            "list). Binary units as Slurm's (K, M, G, T, KiB, MiB, GiB, TiB), decimal with 'GB'/'MB'. "
            "Empty: no verdict."
        ),
    )
    gpu_request: Literal["gres", "gpus-per-node"] = Field(
        "gres",
        description="How GPUs are requested: '--gres=<gres_name>:<n>' or '--gpus-per-node=<n>'.",
    )
    gres_name: GresName = Field(
        "gpu",
        description="Gres name, optionally typed, e.g. 'gpu' or 'gpu:h100'.",
    )
    gpu_compute: bool = Field(
        True,
        description=(
            "Whether ranks compute on the GPUs Slurm gives them. false: Slurm schedules the GPUs as on a GPU "
            "site (the request, CUDA_VISIBLE_DEVICES, the start probe's count) while the ranks compute on the "
            "CPU over gloo and record the GPU each would have used; the dev cluster's fake GPUs "
            "(`jobgen cluster up --gpus`, site 'local-gpu')."
        ),
    )
    cpus_per_node: int = Field(2, ge=1, le=1024, description="CPUs for the one task per node (--cpus-per-task).")
    mem: SlurmMemory | None = Field(
        None, description="Memory per node (--mem): '0' for all of it, or e.g. '480G'. Empty to omit."
    )
    exclusive: bool = Field(False, description="Ask for whole nodes (--exclusive).")
    hint_nomultithread: bool = Field(False, description="Add --hint=nomultithread (one thread per core for the task).")
    output_per_node: bool = Field(
        False,
        description="Also write each node's training output to its own file (srun --output with %N).",
    )
    signal: Literal["USR1", "USR2"] = Field(
        "USR1",
        description="Signal Slurm sends the batch shell exit_grace before the time limit (--signal=B:SIG@T).",
    )
    requeue: bool = Field(True, description="Let Slurm requeue the job after preemption or node failure (--requeue).")
    in_job_restarts: int | None = Field(
        None,
        ge=0,
        le=MAX_IN_JOB_RESTARTS,
        description=(
            "Default of job.in_job_restarts (relaunches of the program inside one array task after a failure "
            f"that may not repeat). Unset: {GPU_SITE_IN_JOB_RESTARTS} where the ranks compute on GPUs, 0 "
            "elsewhere (the dev cluster's sites)."
        ),
    )
    node_shapes: list[NodeShape] = Field(
        default_factory=list,
        description=(
            "The partition's nodes as Slurm described them to `jobgen site init`, one entry per distinct "
            "(GPUs, CPUs, memory): on a cluster whose nodes differ, a run's job.procs_per_node list is checked "
            "against them (an entry no node can hold is refused). Empty: every node has gpus_per_node GPUs."
        ),
    )
    extra_sbatch: list[SbatchOption] = Field(
        default_factory=list,
        description=(
            "Extra '#SBATCH' options, one per entry as '--name' or '--name=value', e.g. "
            "['--gpu-bind=none', '--comment=my run']; values are passed verbatim (quoted for sbatch)."
        ),
    )

    @property
    def computes_on_gpu(self) -> bool:
        """Whether the ranks compute on GPUs (NCCL, CUDA memory): GPUs asked for and used."""
        return self.gpus_per_node > 0 and self.gpu_compute

    @property
    def default_in_job_restarts(self) -> int:
        """slurm.in_job_restarts, or its default for this kind of site."""
        if self.in_job_restarts is not None:
            return self.in_job_restarts
        return GPU_SITE_IN_JOB_RESTARTS if self.computes_on_gpu else 0

    @property
    def default_procs_per_node(self) -> int:
        """Processes per node when a run leaves job.procs_per_node unset: one per GPU, else 1."""
        return self.gpus_per_node or 1


class NetworkSettings(SpecModel):
    """How ranks find each other and which network NCCL/Gloo use."""

    ifname: InterfaceName | None = Field(
        None,
        description=(
            "Network interface for bootstrap and socket traffic (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, "
            "torchrun --local-addr), e.g. 'ib0', 'eth0', 'enp1s0'. Empty lets NCCL and Gloo guess."
        ),
    )
    transport: Literal["ib", "socket"] = Field(
        "socket",
        description="'ib' for InfiniBand/RoCE; 'socket' for Ethernet-only (sets NCCL_IB_DISABLE=1, NCCL_NET=Socket).",
    )
    ib_hca: IbHca | None = Field(
        None,
        description="NCCL_IB_HCA, e.g. 'mlx5_0,mlx5_1' or '=mlx5_0:1'.",
    )
    resolve_head_ip: bool = Field(
        True,
        description=(
            "Resolve the head node to the IPv4 address of 'ifname' on that node for the rendezvous endpoint, "
            "instead of its hostname (which may resolve to another network)."
        ),
    )
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="Base TCP port of the c10d rendezvous.")
    rdzv_port_spread: int = Field(
        1000,
        ge=0,
        le=20000,
        description=(
            "The port is rdzv_port + (job id mod spread), so jobs that share a head node do not collide; "
            "0 for a fixed port."
        ),
    )
    debug: bool = Field(
        False,
        description="NCCL_DEBUG=INFO with one NCCL_DEBUG_FILE per host and process, TORCH_DISTRIBUTED_DEBUG=DETAIL.",
    )
    env: JobEnv = Field(
        default_factory=dict,
        description=(
            "Extra NCCL/GLOO variables, e.g. {NCCL_IB_GID_INDEX = '3'}; the same names and values are refused "
            "as in the run's [env]."
        ),
    )

    @model_validator(mode="after")
    def _check_port(self) -> NetworkSettings:
        if self.rdzv_port + self.rdzv_port_spread > 65535:
            raise ValueError("rdzv_port + rdzv_port_spread must stay below 65536")
        if self.resolve_head_ip and self.ifname is None:
            # Without an interface there is nothing to resolve on; use the hostname.
            self.resolve_head_ip = False
        return self


class PathSettings(SpecModel):
    """Shared filesystem locations every node sees."""

    runs_root: SafePath = Field(
        "~/jobgen-runs", description="Directory holding one run directory per job name; must be shared by all nodes."
    )
    hf_home: SafePath | None = Field(None, description="HF_HOME for the job (models, tokenizers, datasets cache).")
    data_cache: SafePath | None = Field(
        None,
        description=(
            "Where tokenized datasets are cached, shared by whoever may write it: your own directory, or a "
            "group's with the setgid and sticky bits (chmod 3775; group-writable without them, or writable by "
            "everyone, is refused). Default <runs_root>/.data-cache-<uid>, yours alone (0700) even in a "
            "shared runs root."
        ),
    )
    snapshot_dir: SafePath = Field(
        "/dev/shm",
        description=(
            "Node-local memory (a tmpfs) where train.snapshot_every_steps keeps each rank's snapshots, under "
            "jobgen-<uid>/; not shared between nodes."
        ),
    )


# The key that names each kind's environment: a table with one of them and no kind is that kind.
_KIND_OF_KEY = {"venv": "venv", "conda_env": "conda", "prefix": "prefix"}


class PythonSettings(SpecModel):
    """How the job's Python environment is activated on every node."""

    kind: Literal["auto", "venv", "conda", "prefix", "modules", "container", "none"] = Field(
        "auto",
        description=(
            "'auto': the environment that runs `jobgen submit` (its interpreter's prefix: a venv, a conda "
            "environment or a plain installation), recorded in the run's spec.json as the kind it is; "
            "'venv' (source <venv>/bin/activate), 'conda' (conda activate <conda_env>), 'prefix' (<prefix>/bin "
            "first on PATH), 'modules' (module load ..., then module_venv if set), 'container' (every step in "
            "container_image, started by container_runtime), or 'none' (the nodes' own PATH)."
        ),
    )
    venv: SafePath | None = Field(None, description="Virtualenv directory, when kind = 'venv'.")
    conda_env: SafePath | None = Field(
        None, description="Conda environment, by name ('llm') or prefix ('/shared/envs/llm'), when kind = 'conda'."
    )
    conda_base: SafePath | None = Field(
        None,
        description=(
            "The conda installation whose etc/profile.d/conda.sh defines `conda activate`, when kind = 'conda'; "
            "empty: the `conda` on the nodes' PATH."
        ),
    )
    prefix: SafePath | None = Field(
        None, description="An installation prefix (its bin/ holds python and torchrun), when kind = 'prefix'."
    )
    modules: list[ModuleName] = Field(
        default_factory=list,
        description=(
            "Modules to load in order (after 'module purge'): the whole environment when kind = 'modules', "
            "else loaded before the venv, conda environment or prefix is activated (a CUDA or compiler module)."
        ),
    )
    module_venv: SafePath | None = Field(None, description="Optional virtualenv to activate after loading the modules.")
    container_runtime: ContainerRuntimeName = Field(
        "pyxis",
        description=(
            "What starts the container on each node, when kind = 'container': 'pyxis' (srun --container-image, "
            "NVIDIA's SPANK plugin for enroot), 'apptainer' (apptainer exec) or 'podman' (podman run --network=host "
            "--ipc=host --pid=host). The batch script and the supervisor run on the batch host, outside the image; "
            "every step on the nodes runs inside it (docs/containers.md)."
        ),
    )
    container_image: ContainerImage | None = Field(
        None,
        description=(
            "The image every step runs in, when kind = 'container', as the runtime names it: pyxis "
            "'nvcr.io#nvidia/pytorch:24.05-py3' or a squashfs file, apptainer a .sif file or 'docker://...', "
            "podman 'registry/image:tag'. It holds jobgen and the trainer's packages (`jobgen image build`)."
        ),
    )
    container_mounts: list[str] = Field(
        default_factory=list,
        description=(
            "Extra 'src:dst[:flags]' mounts. The runs root, the data cache, HF_HOME, the snapshot directory, "
            "the model's, data's and evaluation's directories and jobgen's checkout (when jobgen runs from one) "
            "are always mounted at their own paths."
        ),
    )
    host_python: SafePath | None = Field(
        None,
        description=(
            "When kind = 'container': the Python on the batch host that runs the job's supervisor "
            "(python -m jobgen.job) outside the image; it needs jobgen, on a path every node sees. "
            "Default: the Python of the environment that runs `jobgen submit` (recorded then, as kind = 'auto' is)."
        ),
    )
    container_options: list[ContainerOption] = Field(
        default_factory=list,
        description=(
            "The site's own options for the runtime, after jobgen's, e.g. podman's '--device=/dev/infiniband' or "
            "'--userns=keep-id', apptainer's '--writable-tmpfs', pyxis's '--container-writable'."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _kind_from_its_key(cls, data: object) -> object:
        """A table that names one environment and no kind is that kind: ``[python] venv = ...``
        meant a venv when kind defaulted to 'venv', and must not become the submitter's."""
        if isinstance(data, dict) and "kind" not in data:
            named = [kind for key, kind in _KIND_OF_KEY.items() if data.get(key) is not None]
            if len(named) == 1:
                return {**data, "kind": named[0]}
        return data

    @model_validator(mode="after")
    def _check_kind(self) -> PythonSettings:
        given = [key for key in _KIND_OF_KEY if getattr(self, key) is not None]
        if self.kind == "auto" and given:
            raise ValueError(
                f"kind = 'auto' activates the environment that runs `jobgen submit`; '{given[0]}' names another: "
                f"set kind = '{_KIND_OF_KEY[given[0]]}', or remove '{given[0]}'"
            )
        needs = {"venv": ("venv", self.venv), "conda": ("conda_env", self.conda_env), "prefix": ("prefix", self.prefix)}
        if self.kind in needs and not needs[self.kind][1]:
            raise ValueError(f"kind = '{self.kind}' needs '{needs[self.kind][0]}'")
        if self.kind == "modules" and not self.modules:
            raise ValueError("kind = 'modules' needs a non-empty 'modules' list")
        if self.kind == "container" and not self.container_image:
            raise ValueError("kind = 'container' needs 'container_image'")
        if self.host_python and self.kind != "container":
            raise ValueError(
                f"'host_python' is for kind = 'container' (the supervisor outside the image); kind is '{self.kind}'"
            )
        for mount in self.container_mounts:
            if not all(c.isalnum() or c in "_./:+@=-" for c in mount):
                raise ValueError(f"container mount {mount!r} has characters outside [A-Za-z0-9_./:+@=-]")
        if self.kind == "container":
            self._check_container()
        return self

    def _check_container(self) -> None:
        """What the runtime cannot honour, named by key: another runtime's image syntax, a mount
        flag it does not know, an option of another runtime."""
        runtime = self.container_runtime
        problem = containers.image_problem(runtime, self.container_image or "")
        if problem:
            raise ValueError(f"container_image {problem} (container_runtime = '{runtime}')")
        for mount in self.container_mounts:
            problem = containers.mount_problem(runtime, mount)
            if problem:
                raise ValueError(f"container_mounts: {problem}")
        for option in self.container_options:
            problem = containers.option_problem(runtime, option)
            if problem:
                raise ValueError(f"container_options: {problem}")

    @property
    def interpreter(self) -> str | None:
        """The environment's python as the nodes run it, where the profile says which (a venv, a
        prefix, a conda environment by prefix); None where only the nodes know (modules, a conda
        environment by name, a container, the nodes' PATH)."""
        if self.kind == "venv" and self.venv:
            return f"{self.venv}/bin/python"
        if self.kind == "prefix" and self.prefix:
            return f"{self.prefix}/bin/python"
        if self.kind == "conda" and self.conda_env and "/" in self.conda_env:
            return f"{self.conda_env}/bin/python"
        if self.kind == "modules" and self.module_venv:
            return f"{self.module_venv}/bin/python"
        return None

    @property
    def activation_file(self) -> str | None:
        """The file the script needs to activate the environment: its absence on a node is one
        line naming it, not a shell error."""
        if self.kind == "venv" and self.venv:
            return f"{self.venv}/bin/activate"
        if self.kind == "modules" and self.module_venv:
            return f"{self.module_venv}/bin/activate"
        if self.kind == "conda" and self.conda_base:
            return f"{self.conda_base}/etc/profile.d/conda.sh"
        return self.interpreter


class SiteProfile(SpecModel):
    """One cluster."""

    name: SiteName = Field(description="Short name of the site.")
    description: str = Field("", description="What this cluster is, for humans.")
    slurm: SlurmSettings = Field(default_factory=SlurmSettings, description="Slurm resource requests.")
    network: NetworkSettings = Field(default_factory=NetworkSettings, description="Rendezvous and NCCL/Gloo network.")
    paths: PathSettings = Field(default_factory=PathSettings, description="Shared filesystem locations.")
    python: PythonSettings = Field(
        default_factory=PythonSettings,
        description="Python environment activation; by default the environment that runs `jobgen submit`.",
    )
    env: JobEnv = Field(
        default_factory=dict,
        description=(
            "Variables exported in every job of this site (the run's [env] wins); the same names and values are "
            "refused as in the run's [env]."
        ),
    )
    watchdogs: WatchdogSettings = Field(
        default_factory=WatchdogSettings,
        description=(
            "Team-wide watchdog defaults (partition, mail relay, webhook); a run's [watchdogs] wins key by key."
        ),
    )
    health_check: EnvValue | None = Field(
        None,
        max_length=1000,
        description=(
            "A command run on every node before each training task or doctor job launches (bash -c, on the host, e.g. "
            "'/usr/sbin/nhc -t 50'). A node where it exits non-zero or takes over 60 s is quarantined for the "
            "run: the task ends FAILED naming it, and the run's later tasks exclude it (jobgen status, "
            "jobgen doctor --clear). GPU sites also check that each node shows gpus_per_node GPUs."
        ),
    )
