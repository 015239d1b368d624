"""The run spec: ``[job]`` and ``[env]`` of ``run.toml``, and RunSpec, the whole file, whose other
tables live in their own modules (``[model]`` in :mod:`jobgen.spec.tables.model`, ``[data]`` in
:mod:`jobgen.spec.tables.data`, ``[train]`` in :mod:`jobgen.spec.tables.train`, ...).

Key names are part of the product contract (``docs/architecture.md``, "Where a new feature
goes"); descriptions are the reference documentation and feed ``jobgen schema``. Loading,
site resolution and error reporting live in :mod:`jobgen.spec.loader`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator, model_validator

from jobgen.base.durations import format_human
from jobgen.base.sizes import parse_size
from jobgen.model.mesh import context_parallel_problem
from jobgen.model.parallelism import ACTIVATION_OFFLOADING, EVAL, LORA, SEVERAL_PROCESSES
from jobgen.program.kinds import PROGRAMS, Program, ProgramName, owned_tables
from jobgen.spec.fields import (
    Constraint,
    Duration,
    EnvName,
    HostList,
    JobEnv,
    JobName,
    SafePath,
    SlurmName,
    SpecModel,
)
from jobgen.spec.tables.command import CommandSpec
from jobgen.spec.tables.data import DataSpec
from jobgen.spec.tables.eval import EvalSpec
from jobgen.spec.tables.model import ModelSpec
from jobgen.spec.tables.serve import ServeSpec
from jobgen.spec.tables.site import MAX_IN_JOB_RESTARTS, DeviceMemory
from jobgen.spec.tables.sweep import SweepSpec
from jobgen.spec.tables.train import TrainSpec
from jobgen.spec.tables.watchdogs import WatchdogSettings

MAX_SPARE_NODES = 64
# Slurm's default MaxArraySize is 1001, so the highest index is 1000.
MAX_ARRAY = 1000
# Processes on one node.
MAX_PROCS_PER_NODE = 256
ProcsPerNode = Annotated[int, Field(ge=1, le=MAX_PROCS_PER_NODE)]


class JobSpec(SpecModel):
    """What to ask Slurm for. Keys here override the site profile's."""

    name: JobName = Field(description="Job name; also the run directory's name under runs_root.")
    program: ProgramName = Field(
        "train",
        description=(
            "'train' runs the bundled trainer; 'doctor' runs the node health check (no model or data needed); "
            "'command' runs your own program from [command] under the same launch and lifecycle."
        ),
    )
    nodes: int = Field(1, ge=1, le=4096, description="Number of nodes.")
    min_nodes: int | None = Field(
        None,
        ge=1,
        le=4096,
        description=(
            "Fewest nodes a task may run on (default: nodes). Below nodes, each task asks Slurm for "
            "--nodes=min_nodes-nodes and whole nodes (--exclusive, without which Slurm starts a range on its "
            "minimum): when quarantine or Slurm leaves fewer healthy nodes, the next task runs on what there is "
            "instead of waiting, and on all of them again once they are back. Needs "
            "train.global_batch_size (or train.allow_batch_change) with the bundled trainer, so that each world "
            "size keeps the batch."
        ),
    )
    procs_per_node: ProcsPerNode | list[ProcsPerNode] | None = Field(
        None,
        description=(
            "Processes per node: GPUs per node on GPU sites (the default), processes on CPU sites (default 1). "
            "A list gives each node its own count, in the order of the allocation's nodes ($SLURM_NODEID, "
            "the order of `scontrol show hostnames`), e.g. [3, 1]: one entry per node (its length is job.nodes), "
            "the world size is their sum, global ranks follow the nodes (ranks 0-2 on the first node, 3 on "
            "the second), and every node is asked for the same CPUs, memory and GPUs (the site's), which must cover "
            "the largest entry. Not with "
            "job.min_nodes below job.nodes, and with parallelism 'hsdp' only with a train.shard_size that "
            "divides every entry."
        ),
    )
    time: Duration = Field(description="Time limit of each array task, e.g. '20:00:00', '2-00:00:00' or '4h'.")
    array: int = Field(
        1,
        ge=1,
        le=MAX_ARRAY,
        description="Number of chained array tasks (--array=1-N%1): the run continues after each time limit.",
    )
    exit_grace: Duration = Field(
        "5m",
        description=(
            "Lead time before the time limit at which the job is told to save and exit (--signal, deadline). "
            "Slurm may signal up to 60 s early; it must cover one step plus one checkpoint save."
        ),
    )
    graceful_stop: bool = Field(
        True,
        description=(
            "Save and exit before Slurm ends the job: on the lead-time signal (exit_grace before the time limit), "
            "at the job's deadline, on SIGTERM (preemption, scancel) and on the batch shell's stop request. false: "
            "none of these is asked for or handled; the program trains until Slurm kills it and each array task "
            "resumes from the last periodic checkpoint, redoing the steps since. For programs that cannot save "
            "on demand, and to measure what graceful stops save (bench/goodput.py). Switch files still work."
        ),
    )
    in_job_restarts: int | None = Field(
        None,
        ge=0,
        le=MAX_IN_JOB_RESTARTS,
        description=(
            "Relaunches of the program inside one array task: when it fails for a reason that may not repeat "
            "(a rank crashed or was killed, a collective timed out), the batch script keeps the allocation and "
            "starts it again on the same nodes, resuming from the newest checkpoint, instead of ending the task "
            "and waiting in the queue for nodes again. A crash that repeats the previous launch's (same exception, "
            "place and step), an error every launch would meet (data, model, settings), a node found at fault (but "
            "for a spare: job.spare_nodes), a "
            "planned stop, a switch or a signal from Slurm end the task as before. Default: the site's "
            "slurm.in_job_restarts. The bundled trainer, and your own program (program 'command'), whose plan is "
            "made again before each relaunch so that it resumes from the newest checkpoint ({latest_checkpoint}); "
            "not the doctor."
        ),
    )
    spare_nodes: int = Field(
        0,
        ge=0,
        le=MAX_SPARE_NODES,
        description=(
            "Nodes held beside job.nodes for a relaunch inside the task to use (job.in_job_restarts): each task "
            "asks Slurm for job.nodes + spare_nodes nodes with --no-kill (Slurm keeps the allocation when one of "
            "them fails and takes that node out of it) and trains on job.nodes of them. When a node is lost or "
            "found at fault, the next launch trains on the healthy ones, a spare among them, with the same world "
            "size and global batch; once no spare is left, a node failure ends the task as without spares. The "
            "spares idle meanwhile (you are charged for them). A node quarantined by then is excluded from the "
            "run's pending tasks, which ask for no more nodes than the partition has left (job.nodes at least), and "
            "for every spare again once `jobgen doctor --clear` releases it. Losing the first node, where the batch "
            "script runs, "
            "ends the allocation: the next array task takes over. Needs job.in_job_restarts of at least 1; not with "
            "job.min_nodes below job.nodes, nor with per-node lists (job.procs_per_node, job.device_memory), "
            "which name no spare."
        ),
    )
    runs_root: SafePath | None = Field(None, description="Overrides the site's paths.runs_root.")
    partition: SlurmName | None = Field(None, description="Overrides the site's slurm.partition.")
    account: SlurmName | None = Field(None, description="Overrides the site's slurm.account.")
    qos: SlurmName | None = Field(None, description="Overrides the site's slurm.qos.")
    constraint: Constraint | None = Field(None, description="Overrides the site's slurm.constraint.")
    exclude: list[HostList] = Field(
        default_factory=list, description="Nodes never to run on (--exclude), e.g. ['gpu017', 'gpu[20-22]']."
    )
    nodelist: list[HostList] = Field(default_factory=list, description="Nodes to run on (--nodelist).")
    device_memory: list[DeviceMemory] | None = Field(
        None,
        description=(
            "Each node's device memory, node by node in the allocation's order (as job.procs_per_node's "
            "entries), for machines with different GPUs, e.g. ['24GB', '80GB']: a pipeline gives each stage "
            "blocks in proportion to the least memory among the ranks that hold it, and `jobgen plan` checks "
            "each pipeline position against its own nodes' memory and names the tightest. One entry per node; "
            "replaces site.slurm.device_memory for this run. Empty: the site's, the same on every node."
        ),
    )
    pass_env: list[EnvName] = Field(
        default_factory=list,
        description=(
            "Variables the job takes from the environment you submit from, e.g. ['HF_TOKEN', 'WANDB_API_KEY']: "
            "sbatch exports the submitting shell's environment to the job, submit checks each one is set, and "
            "their values are never written to disk (secrets belong here, not in [env])."
        ),
    )

    @property
    def kind(self) -> Program:
        """The program's entry (jobgen.program.kinds): what every room needs of it."""
        return PROGRAMS[self.program]

    @property
    def resumable(self) -> bool:
        """A program that saves, resumes and stops on request (the trainer, your own program
        through jobgen.runtime): it runs as a chained array, with the switches, the failed
        and done markers, stop requests and node quarantine."""
        return self.kind.resumable

    @field_validator("exit_grace")
    @classmethod
    def _grace_below_time(cls, grace: int, info: ValidationInfo) -> int:
        time = info.data.get("time")
        if time is not None and grace >= time:
            raise ValueError(
                f"exit_grace ({format_human(grace)}) must be shorter than time ({format_human(time)}):"
                " the job would be told to exit before it starts"
            )
        return grace

    @field_validator("procs_per_node", mode="before")
    @classmethod
    def _whole_counts(cls, value: object) -> object:
        """One message naming the entry, instead of pydantic's one per member of the union."""
        if value is None:
            return value
        counts = value if isinstance(value, list) else [value]
        if not counts:
            raise ValueError("an empty list: give one number of processes per node, e.g. [3, 1]")
        for index, count in enumerate(counts):
            where = f"entry {index} ({count!r})" if isinstance(value, list) else repr(count)
            if not isinstance(count, int) or isinstance(count, bool):
                raise ValueError(
                    f"{where} is not a whole number of processes: give one number for every node, "
                    "or a list of one number per node (e.g. [3, 1])"
                )
            if not 1 <= count <= MAX_PROCS_PER_NODE:
                raise ValueError(f"{where} must be from 1 to {MAX_PROCS_PER_NODE} processes")
        return value

    @model_validator(mode="after")
    def _restarts_need_a_resumable_program(self) -> JobSpec:
        if self.in_job_restarts and not self.kind.relaunches:
            raise ValueError(
                f"job.in_job_restarts = {self.in_job_restarts}: program '{self.program}' is not relaunched inside "
                "a task (the bundled trainer is); leave job.in_job_restarts unset or 0"
            )
        return self

    @model_validator(mode="after")
    def _spares_replace_equal_nodes(self) -> JobSpec:
        """A spare takes a lost node's place with the world unchanged: only where every node
        is alike and the world has one size."""
        if not self.spare_nodes:
            return self
        key = f"job.spare_nodes = {self.spare_nodes}"
        if not self.kind.relaunches:
            raise ValueError(
                f"{key}: program '{self.program}' is not relaunched inside a task, so no launch would use a spare "
                "(the bundled trainer is); leave job.spare_nodes unset or 0"
            )
        if self.in_job_restarts == 0:
            raise ValueError(f"{key}: a spare is used by a relaunch inside the task, and job.in_job_restarts is 0")
        if len(self.node_counts) > 1:
            raise ValueError(
                f"{key} with job.min_nodes = {self.min_nodes} below job.nodes = {self.nodes}: a spare keeps the "
                "world at job.nodes; choose one (spares keep the world size, min_nodes lets it shrink)"
            )
        for name, value, fix in (
            ("job.procs_per_node", self.procs_per_node, "give one number for every node"),
            ("job.device_memory", self.device_memory, "leave it unset (slurm.device_memory is every node's)"),
        ):
            if isinstance(value, list):
                raise ValueError(
                    f"{key} with {name} = {value}: the list gives node N of the allocation its entry, and a spare "
                    f"taking a lost node's place would take another node's entry; {fix}"
                )
        if self.nodes + self.spare_nodes > 4096:
            raise ValueError(f"{key}: job.nodes + job.spare_nodes is {self.nodes + self.spare_nodes}, above 4096")
        return self

    @model_validator(mode="after")
    def _min_nodes_at_most_nodes(self) -> JobSpec:
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"job.min_nodes ({self.min_nodes}) must be at most job.nodes ({self.nodes})")
        return self

    @model_validator(mode="after")
    def _one_count_per_node(self) -> JobSpec:
        if isinstance(self.procs_per_node, list):
            advice = "leave job.min_nodes unset (or equal to job.nodes) with a list, or give one number for every node"
            self._one_entry_per_node("job.procs_per_node", self.procs_per_node, "processes", advice)
        return self

    @model_validator(mode="after")
    def _one_memory_per_node(self) -> JobSpec:
        if self.device_memory is not None:
            advice = "leave job.min_nodes unset (or equal to job.nodes) with it"
            self._one_entry_per_node("job.device_memory", self.device_memory, "memory", advice)
        return self

    def _one_entry_per_node(self, key: str, entries: list, what: str, advice: str) -> None:
        """A list of ``key`` gives node N of the allocation its entry N: one per node, and never
        with fewer nodes possible."""
        if len(entries) != self.nodes:
            raise ValueError(
                f"{key} = {entries} gives {len(entries)} node(s) their {what}, job.nodes is "
                f"{self.nodes}: give one entry per node"
            )
        if len(self.node_counts) > 1:
            # Which entries would a task on fewer nodes keep? The list names no nodes, and the
            # nodes Slurm leaves out are not known before the task starts.
            raise ValueError(
                f"job.min_nodes = {self.min_nodes} lets a task run on fewer than job.nodes = {self.nodes} nodes, "
                f"and {key} = {entries} says nothing of which entries such a task keeps: {advice}"
            )

    def node_memory(self) -> tuple[int, ...] | None:
        """job.device_memory in bytes, node by node; None when not given."""
        return tuple(parse_size(m) for m in self.device_memory) if self.device_memory else None

    @property
    def node_counts(self) -> range:
        """The node counts a task may get: min_nodes to nodes."""
        return range(self.min_nodes or self.nodes, self.nodes + 1)

    @property
    def allocated_nodes(self) -> int:
        """The most nodes a task asks Slurm for: job.nodes, and the spares beside them."""
        return self.nodes + self.spare_nodes

    @property
    def unequal_nodes(self) -> bool:
        """procs_per_node is a list: each node gets its own count, by its place in the allocation."""
        return isinstance(self.procs_per_node, list)

    def node_procs(self, default: int, nodes: int | None = None) -> tuple[int, ...]:
        """The processes on each node of a task on ``nodes`` nodes (default: job.nodes), in
        node order ($SLURM_NODEID): the list as given, else procs_per_node (``default`` when
        unset: the site's GPUs per node, 1 on CPU sites) on each node. The one place the
        world's shape is derived; :meth:`world_size` sums it."""
        if isinstance(self.procs_per_node, list):
            return tuple(self.procs_per_node)  # a list forbids min_nodes: always job.nodes
        return (self.procs_per_node or default,) * (self.nodes if nodes is None else nodes)

    def world_size(self, default: int, nodes: int | None = None) -> int:
        """Ranks of a task on ``nodes`` nodes (default: job.nodes): the sum of :meth:`node_procs`."""
        return sum(self.node_procs(default, nodes))


def layout_text(node_procs: tuple[int, ...]) -> str:
    """The world's shape in words, as validate, plan, status, doctor and the batch script say
    it: "2 node(s) x 2 process(es)", or "2 nodes with 3 + 1 processes" for unequal nodes."""
    if len(set(node_procs)) <= 1:
        return f"{len(node_procs)} node(s) x {node_procs[0] if node_procs else 0} process(es)"
    return f"{len(node_procs)} nodes with {' + '.join(map(str, node_procs))} processes"


class RunSpec(SpecModel):
    """A whole run.toml after the site reference has been taken out."""

    job: JobSpec = Field(description="Slurm request for each array task.")
    model: ModelSpec | None = Field(None, description="Model; required for program = 'train'.")
    data: DataSpec | None = Field(None, description="Data; required for program = 'train'.")
    train: TrainSpec = Field(default_factory=TrainSpec, description="Training loop settings.")
    command: CommandSpec | None = Field(None, description="Your own program; required for program = 'command'.")
    eval: EvalSpec | None = Field(
        None, description="Held-out evaluation, the best checkpoint, early stopping and samples (program = 'train')."
    )
    env: JobEnv = Field(
        default_factory=dict,
        description=(
            "Variables exported in the job, written into the batch script, after the script's own defaults "
            "(OMP_NUM_THREADS, the NCCL settings), which they override. Refused here: a credential, by its name "
            "(HF_TOKEN, HFTOKEN, WANDB_API_KEY, GITHUB_PAT, DATABASE_URL, ...) or by its value (user:password@ in "
            "a URL, a hf_... or ghp_... token): pass it with job.pass_env; and a name the batch script, Slurm, "
            "torchrun or the shell owns (RUN_DIR, SLURM_*, SRUN_*, JOBGEN_*, RANK, MASTER_PORT, "
            "CUDA_VISIBLE_DEVICES, IFS, BASH_ENV, PATH, PYTHONPATH, ...). LD_LIBRARY_PATH, LD_PRELOAD, HOME and "
            "TMPDIR are yours to set (replacing, not appending to, what the site's environment has). "
            "With job.program = 'command' a value "
            "may hold the placeholders of command.resume_args ({run_dir}, {checkpoint_dir}, {latest_checkpoint}, "
            "{job_id}, {task}; {{ and }} are literal braces), expanded for each task by jobgen; such a variable "
            "is set by jobgen's launcher, not by the script, and one that uses {latest_checkpoint} is left unset "
            "while the run has no checkpoint."
        ),
    )
    watchdogs: WatchdogSettings = Field(
        default_factory=WatchdogSettings,
        description="Watchdog checks for this run (jobgen watchdog install); merged over the site's [watchdogs].",
    )
    serve: ServeSpec = Field(
        default_factory=ServeSpec,
        description="`jobgen serve RUN`: an OpenAI-compatible server for an export of the run's checkpoint.",
    )
    sweep: SweepSpec | None = Field(
        None,
        description=(
            "A file with [sweep] is a sweep: each point is this file with the point's keys set, run in its own "
            "directory runs_root/<job.name>/points/<point> (named by its overrides, e.g. lr-0.0003_r-16, or 'base' "
            "for none); the sweep's directory runs_root/<job.name> holds them all, and the Slurm array is "
            "named job.name."
        ),
    )

    @model_validator(mode="after")
    def _check_program(self) -> RunSpec:
        """The tables the program needs, and none that only another program reads."""
        kind = self.job.kind
        missing = kind.missing({table: getattr(self, table) is not None for table in kind.needs})
        if missing:
            raise ValueError(f"program = '{kind.name}' needs {missing}")
        for table, owner in owned_tables():
            if owner is not kind and getattr(self, table) is not None:
                raise ValueError(f"[{table}] is only used with job.program = '{owner.name}' (program is '{kind.name}')")
        return self

    @model_validator(mode="after")
    def _a_mixture_holds_out_its_own(self) -> RunSpec:
        if self.data is not None and self.data.sources is not None and self.eval is not None and self.eval.path:
            # Which source's format would the file be read in? Each source holds out its share instead.
            raise ValueError(
                "eval.path is read in the [data] format of the one source; with [[data.sources]] give "
                "eval.split: each source holds out that share, evaluated per source"
            )
        return self

    @model_validator(mode="after")
    def _fewer_nodes_keep_the_batch(self) -> RunSpec:
        train, job = self.train, self.job
        if not job.kind.trains or len(job.node_counts) == 1:
            return self
        if train.global_batch_size is None and not train.allow_batch_change:
            raise ValueError(
                f"job.min_nodes = {job.min_nodes} lets a task run on fewer than {job.nodes} nodes, which changes "
                "the global batch (train.micro_batch_size x train.grad_accum x world size): set "
                "train.global_batch_size so that grad_accum follows the world size, or train.allow_batch_change "
                "= true"
            )
        return self

    def turned_on(self) -> frozenset[str]:
        """The settings of the whole run that a parallelism or the context-parallel degree may
        refuse, of those that are on (jobgen.model.parallelism names them)."""
        model = self.model
        settings = {
            EVAL: self.eval is not None,
            LORA: model is not None and model.lora is not None,
            ACTIVATION_OFFLOADING: model is not None and model.activation_offloading,
            # An unset procs_per_node is the site's GPUs per node: more than one, for all the spec knows.
            SEVERAL_PROCESSES: self.job.nodes != 1 or self.job.procs_per_node not in (1, [1]),
        }
        return self.train.turned_on() | {key for key, on in settings.items() if on}

    @model_validator(mode="after")
    def _context_parallel_combinations(self) -> RunSpec:
        if not self.job.kind.trains:
            return self
        problem = context_parallel_problem(self.train.strategy, self.train.context_parallel, self.turned_on())
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _parallelism_combinations(self) -> RunSpec:
        """What train.parallelism refuses of the whole run ([train] alone: TrainSpec)."""
        if not self.job.kind.trains:
            return self
        refusal = self.train.strategy.refusal(self.turned_on())
        if refusal is None:
            return self
        ppn = "unset (the site's GPUs per node)" if self.job.procs_per_node is None else str(self.job.procs_per_node)
        raise ValueError(refusal.text(nodes=self.job.nodes, procs_per_node=ppn))
