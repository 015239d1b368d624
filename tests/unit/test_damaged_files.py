"""Every file a run, a sweep or a server writes, damaged in seeded ways (tests/damage.py:
each key's value of the wrong type, numbers no reader can compute with, terminal escapes, a
key removed, the text cut or not UTF-8, a directory, a FIFO or a link in its place), through
every command that reads it: no traceback, no hang, an exit status the command documents
(0, 1, 2), no control character of the file reaching the terminal, and a command that fails
where it succeeded on the valid file names the file.

The commands run in this process (click's runner, the batch script's Python entry points),
one world of valid files (tests/damaged_world.py) damaged one file at a time and put back;
a few cases run as real subprocesses too, to see that the answer is the same. Slurm is
replaced by one that answers with nothing. The seeds are fixed; JOBGEN_DAMAGE_CASES=N takes
N damages of each file instead of the default (JOBGEN_DAMAGE_CASES=all: every one), for a
long local run.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import resource
import signal
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import damaged_world
from damage import Damage, damages, place
from helpers import jobgen

# Damages of each file by default (and the six that are no file, always): every command of the
# file sees about fifty, all files together in well under a minute. JOBGEN_DAMAGE_CASES for more.
DEFAULT_CASES = 40
SEED = 30
# A command that takes longer than this in-process has hung (a FIFO, /dev/zero).
HANG_SECONDS = 5
# ... or reads more than this much more memory (a link to /dev/zero).
MEMORY_BYTES = 1 << 30
# What a terminal acts on: C0 (but newline and tab), DEL, C1 and the bidirectional controls.
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def case_count() -> int | None:
    wanted = os.environ.get("JOBGEN_DAMAGE_CASES", "")
    if wanted == "all":
        return None
    return int(wanted) if wanted.isdigit() else DEFAULT_CASES


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[damaged_world.World]:
    root = tmp_path_factory.mktemp("damaged")
    old = Path.cwd()
    os.chdir(root)
    with damaged_world.slurm_answers_nothing(), pytest.MonkeyPatch.context() as patch:
        world = damaged_world.build(root)
        patch.setenv("JOBGEN_RUNS_ROOT", str(world.runs))
        _no_side_effects(patch)
        yield world
    os.chdir(old)


def _no_side_effects(patch: pytest.MonkeyPatch) -> None:
    """What the commands would do beyond reading: export a checkpoint (torch), draw a figure
    (matplotlib: each would take a second), signal a process, ask a server. The stand-ins do
    what those do with what was read, up to the point they would act on it."""
    import jobgen.cli.main
    import jobgen.report.plot
    import jobgen.serve.status

    exporter = types.ModuleType("trainer.checkpoints.export")  # the export itself (torch) is not reading files
    exporter.ExportError = type("ExportError", (Exception,), {})
    patch.setitem(sys.modules, "trainer.checkpoints.export", exporter)
    patch.setattr(jobgen.cli.main, "_export_checkpoint", lambda run, target, checkpoint, merge, who: str(checkpoint))
    patch.setattr(jobgen.report.plot, "draw", _dates_only)
    patch.setattr(os, "kill", lambda pid, sig: None)
    if hasattr(jobgen.serve.status, "answers"):
        patch.setattr(jobgen.serve.status, "answers", lambda *args, **kwargs: False)


def _dates_only(data, output: Path) -> Path:
    """jobgen.report.plot.draw's part that can fail on what was read: every time as a date."""
    import jobgen.report.plot

    jobgen.report.plot.empty_panels(data)
    times = [t for series in data.metrics.values() for t in series.times]
    times += [at for _, at in data.resumes] + [t for span in data.waits for t in span]
    for t in times:
        dt.datetime.fromtimestamp(t)
    return output


# ---------------------------------------------------------------- running a command


class Hung(Exception):
    pass


@dataclass
class Outcome:
    code: int
    out: str
    crash: str | None  # the exception that escaped, or that the command hung


def _alarm(signum, frame):
    raise Hung(f"no answer within {HANG_SECONDS} s")


def invoke(args: list[str]) -> Outcome:
    """``jobgen ARGS`` in this process."""
    from jobgen.cli.main import main

    result = _bounded(lambda: CliRunner().invoke(main, args, catch_exceptions=True))
    if isinstance(result, Outcome):
        return result
    out = result.stdout + result.stderr
    crash = None
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        crash = f"{type(result.exception).__name__}: {result.exception}"
    return Outcome(result.exit_code, out, crash)


def call(entry: Callable[[list[str]], int], argv: list[str]) -> Outcome:
    """A batch script's Python entry point (``main(argv)``) in this process."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()

    def run() -> Outcome:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                return Outcome(int(entry(argv) or 0), "", None)
            except SystemExit as exc:
                return Outcome(exc.code if isinstance(exc.code, int) else 1, "", None)

    result = _bounded(run)
    result.out = out.getvalue() + err.getvalue() + result.out
    return result


def _bounded(run: Callable):
    """``run()`` within HANG_SECONDS and MEMORY_BYTES more memory: a command that reads a FIFO
    or /dev/zero is a finding, not a test run that hangs or a machine out of memory."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    outer, started = signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()  # pytest-timeout's, if any
    limits = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + MEMORY_BYTES, limits[1]))
    signal.alarm(HANG_SECONDS)
    try:
        return run()
    except Hung as exc:
        return Outcome(-1, "", f"hung: {exc}")
    except MemoryError:
        return Outcome(-1, "", f"read without end: more than {MEMORY_BYTES >> 20} MiB")
    except Exception as exc:  # noqa: BLE001 - what escaped is the finding
        return Outcome(-1, "", f"{type(exc).__name__}: {exc}")
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, limits)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, outer - (time.monotonic() - started)))


def _address_space() -> int:
    """This process's virtual memory now (bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


# ---------------------------------------------------------------- the files and their readers


@dataclass(frozen=True)
class Command:
    """One way of reading the file: ``jobgen ARGS`` (``{run}``, ``{sweep}``, ... filled in from
    the world), or a batch script's entry point (``entry``)."""

    args: tuple[str, ...]
    entry: Callable[[damaged_world.World], Outcome] | None = None
    sets_switch: str | None = None  # stop, save, abort: the switch this command sets

    def run(self, world: damaged_world.World) -> Outcome:
        if self.entry is not None:
            return self.entry(world)
        return invoke([a.format(**places(world)) for a in self.args])

    def __str__(self) -> str:
        return " ".join(self.args) or getattr(self.entry, "__name__", "entry point")


def places(world: damaged_world.World) -> dict[str, str]:
    return {
        "run": str(world.solo.path),
        "own": str(world.own.path),
        "sweep": str(world.sweep),
        "point": f"{world.sweep.name}/{world.point.path.name}",
        "out": str(world.elsewhere / "out"),
    }


def _plan(world: damaged_world.World) -> Outcome:
    """The launcher's reading of a command plan (jobgen.runtime.launch): the plan, or PlanError."""
    from jobgen.launch.command_plan import PlanError, read_plan

    path = world.own.command_plan(damaged_world.JOB, 0)

    def read() -> Outcome:
        try:
            read_plan(path, str(damaged_world.JOB), 0)
        except PlanError as exc:
            return Outcome(1, str(exc), None)
        return Outcome(0, "", None)

    return _bounded(read)


def _claim(world: damaged_world.World) -> Outcome:
    """A sweep task's claim (the batch script's ``python -m jobgen.sweep.claim``)."""
    from jobgen.sweep.claim import main

    return call(
        main, ["--sweep", str(world.sweep), "--job", "40", "--array-job", "19", "--task", "2", "--live-unknown"]
    )


def jobgen_(*args: str, sets_switch: str | None = None) -> Command:
    return Command(args, sets_switch=sets_switch)


STATUS = (jobgen_("status"), jobgen_("status", "{run}"), jobgen_("status", "{run}", "--json"))
OWN_STATUS = (jobgen_("status", "{own}"), jobgen_("status", "{own}", "--json"), jobgen_("status"))
PLOT = jobgen_("plot", "{run}", "-o", "{out}.png")
LOGS = jobgen_("logs", "{run}")
STOP, SAVE, ABORT = (
    jobgen_(name, "{run}", sets_switch={"stop": "kill"}.get(name, name)) for name in ("stop", "save", "abort")
)
WATCHDOGS = (jobgen_("watchdog", "run", "running", "{run}"), jobgen_("watchdog", "run", "hang", "{run}"))
SWEEP_STATUS = (
    jobgen_("status", "{sweep}"),
    jobgen_("status", "{sweep}", "--json"),
    jobgen_("status", "{point}"),
    jobgen_("compare", "{sweep}"),
)
SERVE = (
    jobgen_("serve", "{run}", "--status"),
    jobgen_("serve", "{run}", "--status", "--json"),
    jobgen_("serve", "{run}", "--stop"),
    jobgen_("chat", "{run}"),
)
CLAIM = Command((), entry=_claim)

# Each file, where it is in the world, and every command that reads it.
FILES: dict[str, tuple[Callable[[damaged_world.World], Path], tuple[Command, ...]]] = {
    "spec.json": (
        lambda w: w.solo.spec_file,
        (*STATUS, jobgen_("compare", "{run}"), LOGS, jobgen_("export", "{run}", "--to", "{out}"), STOP, SAVE, ABORT,
         PLOT, *WATCHDOGS, jobgen_("serve", "{run}", "--status")),
    ),
    "a point's spec.json": (
        lambda w: w.point.spec_file,
        (*SWEEP_STATUS, jobgen_("logs", "{sweep}"), jobgen_("stop", "{sweep}"), jobgen_("status")),
    ),
    "jobs.json": (lambda w: w.solo.jobs_file, (*STATUS, PLOT, LOGS, WATCHDOGS[0])),
    "tasks.jsonl": (lambda w: w.solo.path / "tasks.jsonl", (*STATUS, PLOT, LOGS, STOP)),
    "metrics.jsonl": (
        lambda w: w.solo.path / "metrics.jsonl",
        (*STATUS, jobgen_("compare", "{run}"), jobgen_("compare", "{run}", "--json"), PLOT),
    ),
    "best.json": (
        lambda w: w.solo.best_checkpoint,
        (*STATUS, jobgen_("compare", "{run}"), jobgen_("export", "{run}", "--best", "--to", "{out}")),
    ),
    "samples.jsonl": (
        lambda w: w.solo.samples,
        (jobgen_("samples", "{run}"), jobgen_("samples", "{run}", "--json"),
         jobgen_("samples", "{run}", "--step", "10")),
    ),
    "quarantine.json": (lambda w: w.solo.quarantine, STATUS),
    "a task's end record": (lambda w: w.solo.task_record(damaged_world.JOB, 0), (*STATUS, PLOT, LOGS, STOP)),
    "a rank map": (lambda w: w.solo.rank_map(damaged_world.JOB, 0), (LOGS, jobgen_("logs", "{run}", "--rank", "0"))),
    "the failed marker": (lambda w: w.own.failed_marker, (*OWN_STATUS, jobgen_("compare", "{own}"))),
    "a command plan": (lambda w: w.own.command_plan(damaged_world.JOB, 0), (Command((), entry=_plan),)),
    "trainer_state.json": (
        lambda w: w.own.checkpoints / "checkpoint-10" / "trainer_state.json",
        (*OWN_STATUS, jobgen_("compare", "{own}"), jobgen_("plot", "{own}", "-o", "{out}.png")),
    ),
    "sweep.json": (
        lambda w: w.sweep / "sweep.json",
        (*SWEEP_STATUS, jobgen_("status"), jobgen_("stop", "{sweep}"), jobgen_("logs", "{sweep}"), CLAIM),
    ),
    "claims.jsonl": (lambda w: w.sweep / "claims.jsonl", (*SWEEP_STATUS, CLAIM)),
    "a point's claim": (lambda w: w.sweep / "claims" / f"{w.point.path.name}.json", (*SWEEP_STATUS, CLAIM)),
    "serve-job.json": (lambda w: w.solo.serve_job, SERVE),
    "serve.json": (lambda w: w.solo.serve_address, SERVE),
}  # fmt: skip


def findings(world: damaged_world.World, kind: str, damage: Damage, baseline: dict[Command, Outcome]) -> Iterator[str]:
    """What is wrong with how each command takes ``damage`` to the file of ``kind``."""
    path, commands = FILES[kind]
    place(path(world), damage, world.elsewhere)
    try:
        for command in commands:
            outcome = command.run(world)
            problems = judge(world, command, outcome, baseline[command], path(world))
            yield from (f"{kind} {damage.what!r}, {command}: {problem}" for problem in problems)
            world.clear_switches()  # what one command set must not change what the next one sees
    finally:
        world.reset()


def judge(world, command: Command, outcome: Outcome, valid: Outcome, path: Path) -> Iterator[str]:
    if outcome.crash:
        yield outcome.crash
        return
    if outcome.code not in (0, 1, 2):
        yield f"exit status {outcome.code}"
    if "Traceback" in outcome.out:
        yield f"a traceback: {outcome.out[-300:]!r}"
    raw = RAW_CONTROL.search(outcome.out)
    if raw:
        around = outcome.out[max(0, raw.start() - 60) : raw.end() + 20]
        yield f"a raw control character {raw.group()!r} reached the output: {around!r}"
    if outcome.code != valid.code and path.name not in outcome.out:
        tail = outcome.out[-300:]
        yield f"exit status {outcome.code} (valid: {valid.code}) and the output does not name {path.name}: {tail!r}"
    if command.sets_switch:
        switch = world.solo.switch(command.sets_switch)
        if (outcome.code == 0) != switch.is_file():
            yield f"exit status {outcome.code} but the switch is {'set' if switch.is_file() else 'not set'}"


@pytest.fixture(scope="module")
def baseline(world) -> dict[Command, Outcome]:
    """How every command answers on the valid files."""
    out = {}
    for _, commands in FILES.values():
        for command in commands:
            out[command] = command.run(world)
            world.clear_switches()
    world.reset()
    return out


def test_every_command_answers_on_the_valid_files(world, baseline):
    broken = [f"{c}: {o.crash or o.out[-300:]}" for c, o in baseline.items() if o.crash or o.code not in (0, 1, 2)]
    assert not broken, broken


@pytest.mark.parametrize("kind", list(FILES))
def test_a_damaged_file_is_named_never_a_traceback(world, baseline, kind):
    path, _ = FILES[kind]
    found = []
    for damage in damages(path(world), SEED, case_count()):
        found += findings(world, kind, damage, baseline)
    assert not found, f"{len(found)} finding(s):\n" + "\n".join(found[:40])


# Cases run both in this process and as the installed command: the same exit status, and the
# same lines naming the file (Slurm is absent from the real process: the commands chosen ask
# it nothing).
REAL_PROCESS = [
    ("spec.json", "the whole file is []", ("export", "{run}", "--to", "{out}")),
    ("spec.json", "a FIFO", ("logs", "{run}")),
    ("spec.json", "garbage", ("compare", "{run}")),
    ("best.json", "eval_loss = 'text'", ("compare", "{run}")),
    ("best.json", "a link to /dev/zero", ("export", "{run}", "--best", "--to", "{out}")),
    ("samples.jsonl", "a line '[1, 2]'", ("samples", "{run}")),
    ("samples.jsonl", "a directory", ("samples", "{run}", "--json")),
]


@pytest.mark.parametrize("kind, what, args", REAL_PROCESS, ids=[f"{k}: {w}" for k, w, _ in REAL_PROCESS])
def test_a_real_process_answers_as_the_command_in_this_process(world, kind, what, args):
    path, _ = FILES[kind]
    damage = next(d for d in damages(path(world), SEED, None) if d.what == what)
    place(path(world), damage, world.elsewhere)
    try:
        filled = [a.format(**places(world)) for a in args]
        here = invoke(filled)
        real = jobgen(*filled, env={"JOBGEN_RUNS_ROOT": str(world.runs)}, cwd=world.root, timeout=60)
    finally:
        world.reset()
    assert here.crash is None and "Traceback" not in real.stdout + real.stderr, (here, real.stderr)
    assert real.returncode == here.code, (real.stdout + real.stderr, here.out)

    def naming(text: str) -> list[str]:
        return [line for line in text.splitlines() if path(world).name in line]

    assert naming(real.stdout + real.stderr) == naming(here.out) != [], (real.stdout + real.stderr, here.out)
