"""The one place jobgen talks to Slurm: sbatch, squeue, scontrol, scancel.

Commands run as argument lists (never through a shell) with parsable output
formats; the parsers are plain functions of text so unit tests can feed them
captured output. Nothing here decides policy: preflight and submit do.

It also owns what Slurm's words mean: the one table of job states, node states and
pending reasons (``JOB_ACTIVE``, ``JOB_RUNNING``, ``NODE_UNUSABLE``,
``REASONS_NEVER_CLEAR``, ...) that status, preflight, the scheduler and the watchdogs
decide by, and the classification of a failed command (``SlurmUnavailable`` when no
controller answers), so that no code elsewhere reads Slurm's or an error's text.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import subprocess
from pathlib import Path

from jobgen.slurm.text import (
    MY_JOBS_FORMAT,
    NAMED_FORMAT,
    NODE_STATES_FORMAT,
    SACCT_FIELDS,
    SEP,
    STEPS_FORMAT,
    JobRecord,
    NamedJob,
    QueueEntry,
    job_record,
    parse_config,
    parse_job_id,
    parse_my_jobs,
    parse_named_jobs,
    parse_node_states,
    parse_records,
    parse_sacct,
    parse_steps,
    parse_time,
    parse_version,
    parse_words,
)
from jobgen.slurm.text import fields as fields

# Not used here; kept importable from jobgen.slurm.client, where the rest of the code looks for them.
from jobgen.slurm.text import parse_key_values as parse_key_values
from jobgen.slurm.text import parse_seconds as parse_seconds

DEFAULT_TIMEOUT = 60.0


class SlurmError(RuntimeError):
    """A Slurm command failed; the message carries its stderr."""

    def __init__(self, command: list[str], returncode: int, stderr: str, reason: str = ""):
        self.command = command
        self.returncode = returncode
        self.stderr = stderr.strip()
        # The line of stderr that says why (its last line unless the caller found a better one).
        self.reason = reason or (self.stderr.splitlines()[-1] if self.stderr else "")
        super().__init__(f"{' '.join(command)} failed (exit {returncode}): {self.stderr}")


class SlurmUnavailable(SlurmError):
    """Slurm's client commands are not installed or no controller answers."""


# ---------------------------------------------------------------- states and reasons
# Job states are squeue's %T and scontrol's JobState; node states are scontrol's State,
# flags joined by "+" ("IDLE+DRAIN"). Decide by these sets, never by spelling a state.

# Slurm still holds the job: queued, starting, running, finishing, suspended or being requeued.
# A run with such a job is going somewhere by itself; a watchdog chain with one is alive.
JOB_ACTIVE = frozenset(
    {
        "PENDING",
        "RUNNING",
        "CONFIGURING",
        "COMPLETING",
        "REQUEUED",
        "RESIZING",
        "SUSPENDED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
    }
)
# Waiting in the queue; the pending reason says what for.
JOB_PENDING = frozenset({"PENDING"})
# Has its nodes and has started: booting them, running, or finishing. The run counts as running.
JOB_STARTED = frozenset({"CONFIGURING", "RUNNING", "COMPLETING"})
# Its processes run now: a step can join it (srun --jobid --overlap) and look at them.
JOB_RUNNING = frozenset({"RUNNING"})
# Ended or cancelled, its processes being cleaned up (KillWait, epilog): nothing in it answers any more.
JOB_ENDING = frozenset({"COMPLETING"})
# Ended by a failure of the program or of its nodes (not a time limit, a cancel or a preemption).
JOB_FAILED = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"})

# A node with any of these state flags takes no new job (preflight counts the others).
NODE_UNUSABLE = frozenset(
    {
        "DOWN",
        "DRAIN",
        "DRAINED",
        "DRAINING",
        "FAIL",
        "FAILING",
        "NOT_RESPONDING",
        "FUTURE",
        "POWERED_DOWN",
        "INVALID_REG",
    }
)

# The one of those that is Slurm's suspicion rather than its verdict: set when a message to the
# node's slurmd went unanswered (MessageTimeout), cleared at its next answer, DOWN only after
# SlurmdTimeout. A slurmd busy ending a step's processes (KillWait) misses one for seconds: the
# hour soak saw a healthy node marked so for 20 s after a launch's kill.
NODE_SUSPECTED = frozenset({"NOT_RESPONDING"})

# Pending reasons that never clear by themselves: the job will not start without a person
# (a failed dependency, a hold, a down partition, an account, QOS or constraint it may not use).
REASONS_NEVER_CLEAR = frozenset(
    {
        "DependencyNeverSatisfied",
        "JobHeldAdmin",
        "JobHeldUser",
        "PartitionDown",
        "InvalidAccount",
        "InvalidQOS",
        "QOSNotAllowed",
        "AccountNotAllowed",
        "PartitionConfig",
        "BadConstraints",
    }
)


def client_env() -> dict[str, str]:
    """The environment for Slurm commands. Inside a job (a watchdog's scheduler job, a
    training job) the job's own SLURM_* variables would leak into what we start: sbatch
    would copy them into the new job and srun would read SLURM_NTASKS and friends as
    options for a step of *another* job. SLURM_CONF says which cluster, so it stays."""
    env = dict(os.environ)
    if "SLURM_JOB_ID" in env:
        for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[key]
    return env


def _check_client(args: list[str], env: dict[str, str] | None = None) -> None:
    """SlurmUnavailable before ``args`` is started where it cannot work: no such command, or a
    SLURM_CONF that names no file."""
    env = env if env is not None else dict(os.environ)
    if shutil.which(args[0], path=env.get("PATH")) is None:
        raise SlurmUnavailable(args, 127, f"{args[0]} not found on PATH: no Slurm client on this machine")
    conf = env.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        # Slurm's own commands retry a configuration they cannot open for 60 s before failing.
        raise SlurmUnavailable(args, 1, f"SLURM_CONF={conf}: no such file (unset it, or name your slurm.conf)")


def run(
    args: list[str], *, timeout: float = DEFAULT_TIMEOUT, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``args`` in :func:`client_env`, with ``env``'s variables over it (another cluster's)."""
    full_env = {**client_env(), **(env or {})}
    _check_client(args, full_env)
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=full_env
        )
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(args, 124, f"no answer within {timeout:.0f}s (is slurmctld up?)") from None
    if check and proc.returncode != 0:
        raise failure(args, proc)
    return proc


def failure(args: list[str], proc: subprocess.CompletedProcess[str]) -> SlurmError:
    """The error for a failed command: SlurmUnavailable when no controller answers, or its answer
    cannot be read (a controller restarting, another cluster's daemon or munge on its port: Slurm
    says 'Insane message length' or 'Protocol authentication error'); the callers that can go on
    without Slurm's word (status) then do, saying so, instead of failing."""
    err = proc.stderr or proc.stdout
    unreachable = (
        "Unable to contact slurm controller",
        "Could not establish a configuration source",
        "Insane message length",
        "Protocol authentication error",
        "Zero Bytes were transmitted or received",
        # A client of another release than the controller's (a 22.05 squeue against 24.11).
        "Incompatible versions of client and server code",
    )
    why = next((line.strip() for line in err.splitlines() if any(u in line for u in unreachable)), None)
    if why is None:
        return SlurmError(args, proc.returncode, err)
    return SlurmUnavailable(args, proc.returncode, err, reason=why)


# ---------------------------------------------------------------- parsers
# The ones that read no state are in jobgen.slurm.text (imported above); parse_squeue reads
# one by the table above, so it stays here.


# The name (%j) last: it may hold the separator.
SQUEUE_FORMAT = fields("%A", "%F", "%K", "%T", "%r", "%M", "%l", "%N", "%S", "%j")


def parse_squeue(text: str) -> list[QueueEntry]:
    entries = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(SEP, SQUEUE_FORMAT.count(SEP))
        if len(parts) != SQUEUE_FORMAT.count(SEP) + 1:
            raise ValueError(f"unexpected squeue line {line!r}")
        job, array_job, task, state, reason, elapsed, limit, nodes, start, name = parts
        entries.append(
            QueueEntry(
                job_id=int(job),
                array_job_id=int(array_job) if array_job.isdigit() else int(job),
                array_task=task,
                state=state,
                reason=reason,
                elapsed=elapsed,
                time_limit=limit,
                nodes=nodes,
                name=name,
                # A pending job's %S is the scheduler's estimate, not a start.
                start=parse_time(start) if state not in JOB_PENDING else None,
                expected_start=parse_time(start) if state in JOB_PENDING else None,
            )
        )
    return entries


def accounting_enabled(conf: dict[str, str]) -> bool:
    """Whether ``sacct`` has anything to say on this cluster (``scontrol show config``)."""
    storage = conf.get("AccountingStorageType", "")
    return bool(storage) and not storage.endswith("/none") and storage != "(null)"


# ---------------------------------------------------------------- commands


def version() -> tuple[int, ...]:
    return parse_version(run(["sbatch", "--version"]).stdout)


def partitions() -> list[dict[str, str]]:
    return parse_records(run(["scontrol", "show", "partition", "--oneliner"]).stdout)


def config() -> dict[str, str]:
    return parse_config(run(["scontrol", "show", "config"]).stdout)


def nodes() -> list[dict[str, str]]:
    return parse_records(run(["scontrol", "show", "node", "--oneliner"]).stdout)


def slurmd_addresses(names: list[str]) -> dict[str, tuple[str, int]]:
    """Where each named node's slurmd listens (NodeAddr, and its Port or the cluster's SlurmdPort)."""
    default = slurmd_port()
    return {r["NodeName"]: slurmd_address(r, default) for r in nodes() if r.get("NodeName", "") in names}


def slurmd_address(record: dict[str, str], default_port: int) -> tuple[str, int]:
    """Where the slurmd of a node (its ``scontrol show node`` record) listens."""
    port = record.get("Port", "")
    return record.get("NodeAddr") or record.get("NodeName", ""), int(port) if port.isdigit() else default_port


def slurmd_port() -> int:
    """The cluster's SlurmdPort, for nodes whose record names no Port of their own."""
    return int(config().get("SlurmdPort") or 6818)


def slurmd_answers(address: tuple[str, int], timeout: float = 3.0) -> bool:
    """Does a node's slurmd accept a connection? A node that died (its slurmd gone, or the machine)
    refuses or never answers, seconds after: Slurm itself only says so after SlurmdTimeout."""
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError:
        return False
    return True


def hostnames(expression: str) -> list[str]:
    """Expand a Slurm hostlist (``node[1-3]``) into names."""
    if not expression or expression == "(null)":
        return []
    return run(["scontrol", "show", "hostnames", expression]).stdout.split()


def run_job_step(options: list[str], command: list[str], env: dict[str, str]) -> int:
    """``srun`` outside any allocation: a job of its own, in the foreground, whose one step
    runs ``command`` as ``options`` ask (nodes, tasks, time...) with this environment and
    ``env`` (srun takes the caller's environment to the tasks); its output goes to this
    process's, and its exit status comes back when it ends (Ctrl-C cancels it, as srun does)."""
    args = ["srun", *options, *command]
    _check_client(args)
    return subprocess.run(args, env={**client_env(), **env}, check=False).returncode


def sbatch_test_only(script: Path, options: list[str]) -> str:
    """``sbatch --test-only``: validates the script and the request without queueing.
    Returns Slurm's estimate ("Job N to start at ... on nodes ...")."""
    proc = run(["sbatch", "--test-only", *options, str(script)])
    return (proc.stderr or proc.stdout).strip()


def sbatch(script: Path, options: list[str]) -> int:
    proc = run(["sbatch", "--parsable", *options, str(script)])
    return parse_job_id(proc.stdout)


def queue(job_ids: list[int] | None = None) -> list[QueueEntry]:
    """Pending and running jobs (and array tasks), optionally only these array/job ids."""
    args = ["squeue", "--noheader", "--array", f"--format={SQUEUE_FORMAT}"]
    if job_ids:
        args.append("--jobs=" + ",".join(str(j) for j in job_ids))
    proc = run(args, check=False)
    if proc.returncode != 0:
        # squeue exits 1 for job ids it no longer knows; that means "not queued".
        if "Invalid job id" in proc.stderr:
            return []
        raise failure(args, proc)
    return parse_squeue(proc.stdout)


def steps(job_id: int | str) -> dict[str, str]:
    """The job's running steps: step id ("123.4") -> step name; none once the job has gone."""
    proc = run(["squeue", "--steps", f"--jobs={job_id}", "--noheader", f"--format={STEPS_FORMAT}"], check=False)
    return parse_steps(proc.stdout) if proc.returncode == 0 else {}


def held_nodes(job_id: int | str) -> str | None:
    """The nodes the job holds now (a hostlist expression), or None when squeue does not say."""
    proc = run(["squeue", "--noheader", f"--jobs={job_id}", "--format=%N"], check=False)
    lines = parse_words(proc.stdout) if proc.returncode == 0 else []
    return lines[0] if lines else None


def pending_tasks(array_job_id: int | str) -> list[str]:
    """The array's tasks still pending, as squeue names them ("123_4", "123_[5-7%1]")."""
    args = ["squeue", "--noheader", "--array", f"--jobs={array_job_id}", "--states=PENDING", "--format=%i"]
    proc = run(args, check=False)
    return parse_words(proc.stdout) if proc.returncode == 0 else []


def jobs_named(name: str) -> list[NamedJob]:
    """This user's queued and running jobs called ``name``."""
    proc = run(["squeue", "--noheader", "--me", f"--name={name}", f"--format={NAMED_FORMAT}"])
    return parse_named_jobs(proc.stdout)


def queue_named(name: str) -> list[QueueEntry]:
    """This user's pending and running jobs called ``name``, one entry per array task."""
    args = ["squeue", "--noheader", "--me", "--array", f"--name={name}", f"--format={SQUEUE_FORMAT}"]
    return parse_squeue(run(args).stdout)


def my_jobs() -> list[tuple[str, NamedJob]]:
    """(name, job) of every queued or running job of this user that is no array task (the
    watchdogs' chains it serves are single jobs): one squeue call. The comment comes last and may
    hold the separator; a name that holds it garbles only its own line."""
    proc = run(["squeue", "--noheader", "--me", f"--format={MY_JOBS_FORMAT}"])
    return parse_my_jobs(proc.stdout)


def node_states(*, slurm_conf: str, path: str, timeout: float = 10.0) -> dict[str, str]:
    """``sinfo -N``: node name -> its state ("idle", "idle*", "down*", "mix") on the cluster of
    ``slurm_conf``, with the clients found on ``path`` (the dev cluster's own Slurm, whatever
    this process's environment names)."""
    proc = run(
        ["sinfo", "-h", "-N", f"--format={NODE_STATES_FORMAT}"],
        timeout=timeout,
        env={"SLURM_CONF": slurm_conf, "PATH": path},
    )
    return parse_node_states(proc.stdout)


def run_in_job(
    job_id: int, nodes: int, command: list[str], *, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """A short step inside another, running job: one task on each of its nodes, sharing the
    job's CPUs (``--overlap``) and not counted against its memory (``--mem=0``), so it
    starts even when the job holds the whole allocation. Used to look at a training job
    from the outside (stack dumps, node memory)."""
    args = [
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        "--mem=0",
        "--time=2",
        "--quiet",
        "--kill-on-bad-exit=0",
        "--job-name=jobgen-watchdog-probe",
        *command,
    ]
    return run(args, timeout=timeout, check=False)


def ended_jobs(job_ids: list[int], *, accounting: bool) -> list[JobRecord]:
    """What Slurm remembers of these jobs (array ids take in every task): one ``sacct``
    call where accounting keeps jobs, else ``scontrol show job`` for each id, which knows
    a job until MinJobAge after its end."""
    if not job_ids:
        return []
    if accounting:
        ids = ",".join(str(j) for j in job_ids)
        proc = run(
            [
                "sacct",
                "--noheader",
                "--parsable2",
                f"--delimiter={SEP}",
                "--duplicates",
                f"--jobs={ids}",
                f"--format={SACCT_FIELDS}",
            ]
        )
        return parse_sacct(proc.stdout)
    if len(job_ids) > 1:  # every job the controller still holds, in one call, for a listing's many
        asked = set(job_ids)
        every = (job_record(r) for r in show_job(None))
        return [r for r in every if r is not None and (r.job_id in asked or r.array_job_id in asked)]
    records = (job_record(r) for job_id in job_ids for r in show_job(job_id))
    return [r for r in records if r is not None]


def show_job(job_id: int | None) -> list[dict[str, str]]:
    """``scontrol show job`` records (one per array task); empty once Slurm forgot the job
    (MinJobAge after it ended). ``None``: every job the controller holds."""
    proc = run(["scontrol", "show", "job", "--oneliner", *([] if job_id is None else [str(job_id)])], check=False)
    if proc.returncode != 0:
        return []
    return parse_records(proc.stdout)


def allocated_tres(record: dict[str, str]) -> str:
    """The trackable resources a job holds, from its :func:`show_job` record: Slurm 22.05 names
    them ``TRES``, 23.02 and later ``AllocTRES`` (beside ``ReqTRES``, what it asked for)."""
    return record.get("AllocTRES") or record.get("TRES", "")


def end_time(job_id: str) -> float | None:
    """A job's scheduled end (epoch seconds) from squeue, or None when Slurm does not say (no
    client on the node, no answer, a job without a limit). Asked on a job's own node."""
    try:
        out = run(["squeue", "--noheader", "--jobs", job_id, "--format=%e"], timeout=30, check=False).stdout.strip()
    except (OSError, SlurmError):
        return None
    try:
        # squeue prints the controller's local time without a zone; the node shares it.
        return dt.datetime.strptime(out.splitlines()[0], "%Y-%m-%dT%H:%M:%S").timestamp()
    except (ValueError, IndexError):
        return None


def update_job(job_id: int | str, **fields: str) -> None:
    """``scontrol update JobId=<id> Key=value ...`` (a pending job's ExcNodeList, a comment)."""
    run(["scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items())])


def cancel_in_background(job_id: int | str, *, signal: str) -> subprocess.Popen[bytes]:
    """``scancel --signal`` left running: for a step one of whose nodes is dead, scancel waits
    for that node's answer until the message times out (11 s on the dev cluster, measured),
    while the live nodes' tasks get the signal at once. The caller reaps it (``poll``)."""
    args = ["scancel", f"--signal={signal}", str(job_id)]
    _check_client(args)
    return subprocess.Popen(args, env=client_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def cancel(
    job_id: int | str, *, signal: str | None = None, batch_only: bool = False, pending_only: bool = False
) -> None:
    """``scancel``. An array task must be named ``ARRAYID_TASK``: Slurm 22.05 answers
    ``scancel <the task's own job id>`` with exit 0 and does nothing (slurmctld logs
    "invalid JobId"; measured on the dev cluster). ``pending_only``: an array's tasks that
    have not started, its running ones left alone."""
    args = ["scancel"]
    if signal:
        args.append(f"--signal={signal}")
    if batch_only:
        args.append("--batch")
    if pending_only:
        args.append("--state=PENDING")
    run([*args, str(job_id)])
