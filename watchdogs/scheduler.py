"""Cron on Slurm: one self-resubmitting job per interval, running the job files of its directory.

    jobgen watchdog install RUN [--partition P]   # job files + chains
    jobgen watchdog list | remove [RUN]

Layout of a watchdog home (:class:`WatchdogHome`; default ``<runs_root>/.watchdogs``, on
a filesystem every node sees)::

    cron.1m/ cron.10m/ cron.hourly/ cron.daily/   job files: any executable, run in name order
    chains/<interval>.json                        the chain: its token and its queued job
    logs/<interval>/                              submitit's logs and pickles, cleaned after log_retention
    results/<interval>/<job file>.json            last result of each job file
    state/                                        alert state of each check (watchdogs.notify)
    watchdog.log                                  every alert, reminder and resolved message

Each link of a chain is a submitit job (a pickled call of :func:`run_link`). It first
submits its successor with ``--begin=now+<interval>``, so a link that dies while
running its job files does not end the chain, then cleans old logs, then runs every
job file with what is left of its time limit. The chain record holds a token: a
link whose token is not the record's (the chain was removed, or replaced by a new
install) ends without resubmitting, so there is never more than one chain per
interval, whatever races happen. Records change under an flock.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobgen.base.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from jobgen.base.durations import format_human
from jobgen.slurm import client as slurm
from jobgen.spec.resolved import ResolvedSpec
from watchdogs import CHECKS
from watchdogs.home_trust import check_command, private_directory, untrusted
from watchdogs.notify import append_line, locked

NAMED_INTERVALS = {3600: "hourly", 86400: "daily", 7 * 86400: "weekly"}
ALWAYS = (3600, 86400)  # cron.hourly and cron.daily exist and run, like cron's


def interval_name(seconds: int) -> str:
    return NAMED_INTERVALS.get(seconds) or format_human(seconds)


def chain_job_name(name: str) -> str:
    return f"jobgen-cron-{name}"


@dataclass
class Chain:
    """One interval's chain, as recorded in ``chains/<name>.json``."""

    name: str
    seconds: int
    token: str
    partition: str | None
    account: str | None
    time_limit: int  # seconds
    log_retention: int  # seconds
    job_id: int | None = None  # the queued (or running) link
    installed_at: float = field(default_factory=time.time)
    last_link: int | None = None
    last_start: float | None = None

    @classmethod
    def load(cls, path: Path) -> Chain | None:
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class WatchdogHome:
    """The watchdog home of a runs root (laid out as above): where each interval's job
    files, chain record, logs and results live, and this home's links in Slurm's queue."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def cron_dir(self, name: str) -> Path:
        return self.path / f"cron.{name}"

    def chain_file(self, name: str) -> Path:
        return self.path / "chains" / f"{name}.json"

    def chain_lock(self, name: str):
        return locked(self.path / "chains" / f"{name}.lock")

    def log_dir(self, name: str) -> Path:
        return self.path / "logs" / name

    def result_file(self, name: str, job_file: str) -> Path:
        return self.path / "results" / name / f"{job_file}.json"

    def chains(self) -> list[Chain]:
        found = [Chain.load(p) for p in sorted((self.path / "chains").glob("*.json"))]
        return sorted((c for c in found if c is not None), key=lambda c: c.seconds)

    def queued_links(self, name: str) -> list[slurm.NamedJob]:
        """This home's links of the chain ``name`` that Slurm has queued or running; the
        job comment tells them from another home's chain of the same interval."""
        return [j for j in slurm.jobs_named(chain_job_name(name)) if j.comment == str(self.path)]

    def job_files_of_run(self, run_name: str) -> list[Path]:
        """The check job files `install` wrote for one run, in whatever interval directory."""
        ours = {f"{run_name}.{check}" for check in CHECKS}
        return [p for p in self.path.glob(f"cron.*/{run_name}.*") if p.name in ours]

    def job_files(self, name: str) -> list[Path]:
        """What run-parts would run: executable regular files, not hidden, not editor or temp leftovers."""
        directory = self.cron_dir(name)
        if not directory.is_dir():
            return []
        return sorted(
            p
            for p in directory.iterdir()
            if p.is_file()
            and not p.name.startswith(".")
            and not p.name.endswith(("~", ".tmp", ".swp", ".dpkg-old"))
            and os.access(p, os.X_OK)
        )


@contextlib.contextmanager
def _outside_job_env() -> Iterator[None]:
    """submitit calls sbatch with our environment; from inside a link, drop the link's own
    SLURM_* variables so the successor does not inherit them (see jobgen.slurm.client.client_env)."""
    saved, wanted = dict(os.environ), slurm.client_env()  # read before the clear, or nothing is left
    os.environ.clear()
    os.environ.update(wanted)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def link_parameters(home: WatchdogHome, chain: Chain, begin_seconds: int) -> dict[str, Any]:
    """submitit's parameters of one link. Before submitit unpickles the link, its batch script
    checks that the pickle and its directory are this user's alone (watchdogs.home_trust), and
    it runs in the home: ``python -m`` puts the working directory first on sys.path, and the
    directory a user happened to install from may be one the team can write."""
    minutes = max(1, chain.time_limit // 60)
    pickle = f'{shlex.quote(str(home.log_dir(chain.name)))}/"$SLURM_JOB_ID"_submitted.pkl'
    params: dict[str, Any] = dict(
        job_name=chain_job_name(chain.name),
        time=minutes,
        nodes=1,
        ntasks_per_node=1,
        cpus_per_task=1,
        comment=str(home.path),
        use_srun=False,
        stderr_to_stdout=True,
        wckey="",
        signal_delay_s=min(60, minutes * 15),
        additional_parameters={"begin": f"now+{begin_seconds}", "chdir": str(home.path)},
        setup=[check_command(shlex.quote(sys.executable), pickle)],
    )
    if chain.partition:
        params["partition"] = chain.partition
    if chain.account:
        params["account"] = chain.account
    return params


def submit_link(home: WatchdogHome, chain: Chain, begin_seconds: int) -> int:
    """Queue one link of the chain to start ``begin_seconds`` from now."""
    import submitit

    for directory in (home.path, home.path / "logs", home.log_dir(chain.name)):
        private_directory(directory)
    executor = submitit.SlurmExecutor(folder=home.log_dir(chain.name), max_num_timeout=0)
    executor.update_parameters(**link_parameters(home, chain, begin_seconds))
    # umask 022: the pickle submitit writes must pass the link's own check (no write for others).
    with _outside_job_env(), _umask(0o022):
        job = executor.submit(run_link, str(home.path), chain.name, chain.token)
    return int(job.job_id)


def chain_alive(home: WatchdogHome, chain: Chain | None) -> bool:
    if chain is None or chain.job_id is None:
        return False
    return any(j.job_id == chain.job_id and j.state in slurm.JOB_ACTIVE for j in home.queued_links(chain.name))


def ensure_chain(
    home: WatchdogHome, seconds: int, *, partition: str | None, account: str | None, time_limit: int, log_retention: int
) -> tuple[Chain, bool]:
    """Start the chain for this interval unless one is alive; returns it and whether it is new."""
    name = interval_name(seconds)
    private_directory(home.path)
    private_directory(home.cron_dir(name))
    with home.chain_lock(name):
        current = Chain.load(home.chain_file(name))
        if chain_alive(home, current):
            return current, False
        chain = Chain(name, seconds, uuid.uuid4().hex, partition, account, time_limit, log_retention)
        # Recorded before the first link exists: the link checks its token against this file.
        write_json_atomic(home.chain_file(name), asdict(chain))
        try:
            chain.job_id = submit_link(home, chain, 0)
        except BaseException:
            home.chain_file(name).unlink(missing_ok=True)
            raise
        write_json_atomic(home.chain_file(name), asdict(chain))
        return chain, True


# How long remove waits for the links it cancelled to leave Slurm's queue.
REMOVE_WAIT_SECONDS = 60


def stop_chain(home: WatchdogHome, name: str, wait: float = REMOVE_WAIT_SECONDS) -> list[int]:
    """Forget the chain, then cancel every link of it Slurm holds, queued or running, and wait
    until none is left in the queue: remove leaves nothing queued, whatever the chain was doing.

    The record goes first, under the chain's lock: a link hands over (queues its successor and
    records it) only while it holds that lock and finds the record, so once the record is gone
    no link queues another, and a successor queued before is in Slurm's queue by the time the
    lock is ours, where the listing below finds it. A running link is cancelled too (it would
    end by itself, finding no record, but not before remove returned); a link is a check,
    and its record writes are atomic, so cancelling one in the middle loses nothing."""
    with home.chain_lock(name):
        home.chain_file(name).unlink(missing_ok=True)
    cancelled = []
    for job in home.queued_links(name):
        if job.state in slurm.JOB_ACTIVE:
            slurm.cancel(job.job_id)
            cancelled.append(job.job_id)
    deadline = time.monotonic() + wait
    while cancelled and home.queued_links(name) and time.monotonic() < deadline:
        time.sleep(0.5)
    return cancelled


def write_job_file(home: WatchdogHome, seconds: int, file_name: str, text: str) -> Path:
    private_directory(home.path)
    directory = private_directory(home.cron_dir(interval_name(seconds)))
    path = directory / file_name
    write_text_atomic(path, text, mode=0o755)
    return path


def clean_logs(home: WatchdogHome, retention: int, now: float | None = None, keep_jobs: set[int] = frozenset()) -> int:
    """Delete scheduler logs and pickles older than ``retention`` seconds; returns how many.
    Files of the queued links (``keep_jobs``) stay whatever their age: a weekly link's
    pickle waits a week for its job to start."""
    cutoff = (now or time.time()) - retention
    removed = 0
    for path in (home.path / "logs").rglob("*"):
        if path.name.split("_", 1)[0] in {str(j) for j in keep_jobs}:
            continue
        try:
            if path.is_file() and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def run_job_files(home: WatchdogHome, chain: Chain, deadline: float) -> list[dict[str, Any]]:
    """Run the chain's job files one after another within the link's deadline; each one's
    result goes to ``results/<interval>/``."""
    results = []
    for path in home.job_files(chain.name):
        started = time.time()
        left = deadline - started
        if left < 5:
            results.append({"job_file": path.name, "skipped": "no time left in this link"})
            continue
        refused = untrusted(path)  # another user's file would run as this one
        if refused is not None:
            code, output = 126, f"refusing to run {path}: {refused}"
        else:
            code, output = _run_job_file(path, left)
        record = {
            "job_file": path.name,
            "started": started,
            "seconds": round(time.time() - started, 2),
            "exit_code": code,
            "output": output[-4000:],
            "job_id": os.environ.get("SLURM_JOB_ID"),
        }
        result_path = home.result_file(chain.name, path.name)
        result_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(result_path, record)
        print(f"{path.name}: exit {code} in {record['seconds']}s\n{output.rstrip()}", flush=True)
        results.append(record)
    return results


def _run_job_file(path: Path, left: float) -> tuple[int, str]:
    try:
        proc = subprocess.run([str(path)], capture_output=True, text=True, timeout=left, stdin=subprocess.DEVNULL)
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        return 124, f"{exc.stdout or ''}timed out after {left:.0f}s"
    except OSError as exc:
        return 126, f"cannot run: {exc}"


def _submit_with_retries(home: WatchdogHome, chain: Chain, attempts: int = 3) -> int:
    """The successor must be queued or the chain ends: ride out a controller that is
    restarting or briefly too busy to answer."""
    for attempt in range(1, attempts + 1):
        try:
            return submit_link(home, chain, chain.seconds)
        except Exception as exc:
            if attempt == attempts:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
                append_line(
                    home.path / "watchdog.log",
                    f"{stamp} chain {chain.name} ENDED: could not queue its next "
                    f"link: {exc}\n    `jobgen watchdog install RUN` starts it again",
                )
                raise
            time.sleep(10 * attempt)
    raise AssertionError("unreachable")


def run_link(home_path: str, name: str, token: str) -> dict[str, Any]:
    """One tick of a chain, inside its Slurm job: resubmit, clean, run the job files."""
    started = time.time()
    home = WatchdogHome(Path(home_path))
    my_id = int(os.environ.get("SLURM_JOB_ID", "0"))
    with home.chain_lock(name):
        chain = Chain.load(home.chain_file(name))
        # Only the link the record names may continue the chain: not one of a removed or
        # replaced chain, and not this link run a second time (a requeue after preemption).
        if chain is None or chain.token != token or chain.job_id != my_id:
            print(
                f"chain {name}: link {my_id} is not the recorded one "
                f"({'no record' if chain is None else f'record names job {chain.job_id}'}); it ends here",
                flush=True,
            )
            return {"ended": True}
        successor = _submit_with_retries(home, chain)
        chain.job_id, chain.last_link, chain.last_start = successor, my_id, started
        write_json_atomic(home.chain_file(name), asdict(chain))
    print(f"link {my_id} of chain {name}: next link {successor} begins in {format_human(chain.seconds)}", flush=True)
    queued = {c.job_id for c in home.chains() if c.job_id is not None}
    removed = clean_logs(home, chain.log_retention, keep_jobs=queued)
    if removed:
        print(f"removed {removed} scheduler log file(s) older than {format_human(chain.log_retention)}", flush=True)
    # Leave a minute for submitit's bookkeeping before Slurm's time limit.
    deadline = started + chain.time_limit - 60
    return {"successor": successor, "results": run_job_files(home, chain, deadline)}


def install_run(home: WatchdogHome, run_dir: Path, spec: ResolvedSpec, partition: str | None) -> list[str]:
    """Write the run's job files and make sure a chain runs each interval; returns what
    was done, line by line. All or nothing: if a chain cannot be started (a partition
    that does not exist, a time limit above its MaxTime), the chains this call started
    are stopped and the run's job files are put back as they were."""
    settings, name = spec.run.watchdogs, spec.run.job.name
    private_directory(home.path)  # another user's home: refused before anything in it is touched
    wanted = {f"{name}.{check}": settings.check(check).every for check in CHECKS if settings.check(check).enabled}
    before = {p: p.read_bytes() for p in home.job_files_of_run(name)}
    started: list[Chain] = []
    lines = []
    try:
        for path in before:  # disabled since, or moved to another interval
            every = wanted.get(path.name)
            if every is None or path.parent.name != f"cron.{interval_name(every)}":
                path.unlink()
        for file_name, every in wanted.items():
            module = f"watchdogs.{file_name.rsplit('.', 1)[1]}"
            text = job_file_text(sys.executable, module, run_dir, name, interval_name(every))
            lines.append(f"job file {write_job_file(home, every, file_name, text)}")
        for seconds in sorted(set(ALWAYS) | set(wanted.values())):
            chain, new = ensure_chain(
                home,
                seconds,
                partition=partition or settings.partition or spec.partition,
                account=settings.account or spec.account,
                time_limit=settings.time,
                log_retention=settings.log_retention,
            )
            if new:
                started.append(chain)
            lines.append(
                f"chain {chain.name:<7} {'started' if new else 'already running'}: job {chain.job_id} "
                f"({chain.partition or 'default partition'})"
            )
    except BaseException:
        for chain in started:
            stop_chain(home, chain.name)
        for path in home.job_files_of_run(name):
            path.unlink()
        for path, data in before.items():
            write_bytes_atomic(path, data, mode=0o755)
        raise
    return lines


def job_file_text(python: str, module: str, run_dir: Path, run_name: str, interval: str) -> str:
    return (
        "#!/bin/sh\n"
        f"# Installed by `jobgen watchdog install`: the {module.split('.')[-1]} check of run {run_name}, "
        f"every {interval}.\n"
        f"# Remove with: jobgen watchdog remove {shlex.quote(str(run_dir))}\n"
        f"exec {shlex.quote(python)} -m {module} --run {shlex.quote(str(run_dir))} --notify\n"
    )
