"""Pure parsers of Slurm's text: ``scontrol show`` records and config, versions, job ids,
times, ``sacct`` and ``squeue --name`` lines, and the records they make.

Plain functions of captured output, so that unit tests can feed them text; they run no
command and decide nothing by a state. :mod:`jobgen.slurm.client` runs the commands, owns the
one table of states (and ``parse_squeue``, which reads a state by it), and re-exports
every public name here: import them from there.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

# The field separator of every squeue --format and sacct --delimiter jobgen asks for: ASCII's unit
# separator. No separator is one no field can hold: Slurm takes any byte in a job's name and
# comment ('|', --parsable2's own, and this one were both measured in names on 22.05 and 24.11).
# This is one nobody types, and every format puts its free text last (the name, then the
# comment) and is split from the left, so a separator in the comment shifts no other field.
SEP = "\x1f"


def fields(*codes: str) -> str:
    """A format of these squeue codes (or sacct field names), separated by :data:`SEP`."""
    return SEP.join(codes)


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=")


def parse_key_values(line: str) -> dict[str, str]:
    """One ``scontrol show ... --oneliner`` record. Values may contain spaces
    (``Reason=Not responding``), so a value runs until the next ``Key=``."""
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[match.group(1)] = line[match.end() : end].strip()
    return out


def parse_records(text: str) -> list[dict[str, str]]:
    return [parse_key_values(line) for line in text.splitlines() if line.strip() and "=" in line]


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Key = value`` lines (the header line has no ``=``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_seconds(value: str) -> int | None:
    """``30 sec`` / ``30`` / ``0`` → seconds; None for anything else (``UNLIMITED``)."""
    match = re.fullmatch(r"(\d+)(?:\s*sec)?", value.strip())
    return int(match.group(1)) if match else None


def parse_version(text: str) -> tuple[int, ...]:
    """``slurm 22.05.8`` / ``slurm-wlm 22.05.8`` → (22, 5, 8)."""
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"no Slurm version in {text!r}")
    return tuple(int(x) for x in match.groups() if x is not None)


def parse_job_id(text: str) -> int:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    first = text.strip().splitlines()[-1].split(";")[0] if text.strip() else ""
    if not first.isdigit():
        raise ValueError(f"no job id in sbatch output {text!r}")
    return int(first)


def parse_time(text: str) -> float | None:
    """Slurm's ``2026-11-22T14:01:02`` (the controller's local time, which this host
    shares) as epoch seconds; None for ``Unknown``, ``N/A``, ``None`` and the like."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


@dataclass(frozen=True)
class JobRecord:
    """One ended (or ending) job as Slurm remembers it: ``scontrol show job`` until
    MinJobAge after its end, ``sacct`` for as long as accounting keeps it."""

    job_id: int
    array_job_id: int
    array_task: str  # task index, or "N/A" for a job outside an array
    name: str
    state: str
    exit_code: str  # "N:S": the exit status and the signal that ended the batch script
    reason: str
    nodes: str
    start: float | None
    end: float | None
    time_limit: int | None  # seconds
    comment: str
    restarts: int


def job_record(record: dict[str, str]) -> JobRecord | None:
    """A ``scontrol show job --oneliner`` record; None for the line of an array's pending
    rest (``ArrayTaskId=2-3%1``), which is no task of its own."""
    from jobgen.base.durations import parse_slurm_limit

    job_id, array_job, task = record.get("JobId", ""), record.get("ArrayJobId", ""), record.get("ArrayTaskId", "N/A")
    if not job_id.isdigit() or not (task == "N/A" or task.isdigit()):
        return None
    comment = record.get("Comment", "")
    return JobRecord(
        job_id=int(job_id),
        array_job_id=int(array_job) if array_job.isdigit() else int(job_id),
        array_task=task,
        name=record.get("JobName", ""),
        state=record.get("JobState", "UNKNOWN"),
        exit_code=record.get("ExitCode", ""),
        reason=record.get("Reason", ""),
        nodes=record.get("NodeList", ""),
        start=parse_time(record.get("StartTime", "")),
        end=parse_time(record.get("EndTime", "")),
        time_limit=parse_slurm_limit(record.get("TimeLimit", "")),
        comment="" if comment == "(null)" else comment,
        restarts=int(record.get("Restarts", "0") or 0),
    )


# Asked with --delimiter=SEP; the name and the comment, free text, last.
SACCT_FIELDS = "JobIDRaw,JobID,State,ExitCode,Reason,NodeList,Start,End,TimelimitRaw,JobName,Comment"


def parse_sacct(text: str) -> list[JobRecord]:
    """``sacct --parsable2 --delimiter=SEP --noheader --format=SACCT_FIELDS``: one line per job
    and one per step (``5.batch``, ``5.0``); only the jobs' lines are kept. The comment, last,
    may hold the separator. With ``--duplicates`` a requeued job has one line per start, oldest first
    (``REQUEUED``, ...): each line's ``restarts`` counts the lines of that job before it. A
    job is its id and its name: ids are unique for one controller's lifetime only, and the
    accounting database keeps the jobs of earlier lifetimes, so a recycled id also returns
    another job's line, which is no earlier start of this one.

    A job that lost a node and kept running (``--no-kill``, job.spare_nodes) is resized:
    its line until then is ``RESIZING`` and a new line of the same job goes on from the
    resize with the nodes left (measured on the dev cluster). That is one start: the
    ``RESIZING`` line is dropped and its start given to the line after it."""
    out = []
    starts: dict[tuple[int, str], int] = {}
    resized_from: dict[tuple[int, str], str] = {}  # the start of a job's line before its resize
    for line in text.splitlines():
        parts = line.split(SEP, SACCT_FIELDS.count(","))
        if len(parts) != SACCT_FIELDS.count(",") + 1 or not parts[0].isdigit():
            continue  # a step's line (5.batch), or nothing
        raw, job_id, state, exit_code, reason, nodes, start, end, limit_minutes, name, comment = parts
        array_job, in_array, task = job_id.partition("_")
        if in_array and not task.isdigit():
            continue  # an array's pending rest (2_[3-4%1]): squeue's business
        if state == "RESIZING":
            resized_from.setdefault((int(raw), name), start)
            continue
        start = resized_from.pop((int(raw), name), start)
        out.append(
            JobRecord(
                job_id=int(raw),
                array_job_id=int(array_job) if array_job.isdigit() else int(raw),
                array_task=task if task.isdigit() else "N/A",
                name=name,
                state=state.split()[0] if state else "UNKNOWN",  # "CANCELLED by 0"
                exit_code=exit_code,
                reason=reason,
                nodes=nodes,
                start=parse_time(start),
                end=parse_time(end),
                # Minutes; "Partition_Limit" for a job that asked for none, "UNLIMITED".
                time_limit=int(limit_minutes) * 60 if limit_minutes.isdigit() else None,
                comment=comment,
                restarts=starts.get((int(raw), name), 0),
            )
        )
        starts[(int(raw), name)] = starts.get((int(raw), name), 0) + 1
    return out


@dataclass(frozen=True)
class NamedJob:
    """One job of ``squeue --name``: enough to recognise a watchdog scheduler chain."""

    job_id: int
    state: str
    start_time: str  # expected start for pending jobs (their --begin), actual for running ones
    user: str
    comment: str


NAMED_FORMAT = fields("%i", "%T", "%S", "%u", "%k")


def parse_named_jobs(text: str) -> list[NamedJob]:
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(SEP, NAMED_FORMAT.count(SEP))
        if len(parts) != NAMED_FORMAT.count(SEP) + 1:
            raise ValueError(f"unexpected squeue line {line!r}")
        if not parts[0].isdigit():
            continue  # an array task (5_1, 5_[2-3%1]): the chains looked for by name are single jobs
        job, state, start, user, comment = parts
        jobs.append(NamedJob(int(job), state, start, user, "" if comment == "(null)" else comment))
    return jobs


@dataclass(frozen=True)
class QueueEntry:
    """One line of ``squeue --array`` (one array task per line)."""

    job_id: int  # this task's own job id (%A)
    array_job_id: int  # the array's id (%F); equal to job_id for non-array jobs
    array_task: str  # task index, or a pending range like "[2-4%1]", or "N/A"
    state: str
    reason: str
    elapsed: str
    time_limit: str
    nodes: str
    name: str
    start: float | None = None  # when it started (epoch seconds); None while pending
    expected_start: float | None = None  # while pending: the scheduler's estimate, when it has one

    @property
    def slurm_id(self) -> str:
        """How scontrol and scancel name it: ``ARRAYID_TASK`` for an array task (a task's own
        job id does not work for them, see :func:`cancel`), else the job id."""
        if self.array_task.isdigit():
            return f"{self.array_job_id}_{self.array_task}"
        return str(self.job_id)


STEPS_FORMAT = fields("%i", "%j")


def parse_steps(text: str) -> dict[str, str]:
    """``squeue --steps --format=STEPS_FORMAT`` lines: step id ("123.4", "123.batch") -> name.
    The name is last: it may hold the separator."""
    return dict(line.strip().split(SEP, 1) for line in text.splitlines() if SEP in line)


def parse_words(text: str) -> list[str]:
    """One value per line (``squeue --format=%N`` or ``%i``), blank lines left out."""
    return [line.strip() for line in text.splitlines() if line.strip()]


MY_JOBS_FORMAT = fields("%i", "%T", "%S", "%u", "%j", "%k")


def parse_my_jobs(text: str) -> list[tuple[str, NamedJob]]:
    """``squeue --me --format=MY_JOBS_FORMAT``: (name, job) of each line whose id is a job's (an
    array task's, 5_1 or 5_[2-3%1], is left out)."""
    out = []
    for line in text.splitlines():
        parts = line.split(SEP, MY_JOBS_FORMAT.count(SEP))
        if len(parts) != MY_JOBS_FORMAT.count(SEP) + 1 or not parts[0].isdigit():
            continue
        job, state, start, user, name, comment = parts
        out.append((name, NamedJob(int(job), state, start, user, "" if comment == "(null)" else comment)))
    return out


NODE_STATES_FORMAT = fields("%N", "%t")


def parse_node_states(text: str) -> dict[str, str]:
    """``sinfo -N --format=NODE_STATES_FORMAT``: node name -> state. A node in two partitions is
    listed twice, with the same state."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, state = line.strip().partition(SEP)
        if sep and name and state:
            states[name] = state
    return states
