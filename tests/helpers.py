"""What the test modules share: one helper per need.

- Running things as a user does: ``jobgen`` (the installed console script),
  ``jobgen_as`` (the same as another user) and ``torchrun`` (the trainer's entry point,
  as the rendered script launches it); ``local_receivers`` for alert mail and webhooks.
- Writing a run spec: ``write_spec`` (TOML text as written), ``run_spec`` (TOML from
  tables given as dicts) and, on top of it, ``doctor_spec``, ``make_run`` (a run
  directory for ``torchrun`` on this machine) and ``train_spec`` (a training run for
  the dev cluster).
- Reading what a run wrote: ``read_jsonl`` (the product's own reader, which skips a
  line a crash cut), ``losses``, ``last_step``, ``first_step_record``, ``exit_record``,
  ``summary``, ``checkpoints``, ``status`` (``jobgen status RUN --json``).
- Waiting: ``wait_for`` is the only polling loop; ``wait_for_step``,
  ``wait_until_gone`` and ``running_task`` are conditions built on it.

Test modules import these with ``from helpers import ...`` (pytest puts tests/ on
``sys.path``); ``bench/`` does too. Fixtures live in conftest.py.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

from jobgen.base.paths import EXAMPLES_DIR
from jobgen.runs.jsonl_records import read_jsonl

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
DATA = EXAMPLES_DIR / "data" / "instructions.jsonl"
# The tokenized-data cache the runs of a test session share, as the runs of one runs root do
# (its .data-cache-<uid>): only a session's first start builds an entry (tests/conftest.py sets it for
# distributed/, cluster/ and soak/; the data cache's own tests keep theirs under each runs root).
SHARED_DATA_CACHE_ENV = "JOBGEN_TESTS_DATA_CACHE"
# Which Slurm the dev cluster runs (`jobgen cluster up --slurm`): this machine's packages unless
# JOBGEN_TEST_SLURM names another series (docs/testing.md: the 24.11 run).
TEST_SLURM_ENV = "JOBGEN_TEST_SLURM"


def slurm_series_under_test() -> str:
    """The Slurm series the tests' dev cluster runs."""
    from jobgen.devcluster.state import SYSTEM_SERIES

    return os.environ.get(TEST_SLURM_ENV) or SYSTEM_SERIES


# The dev cluster's runs that train until something stops them (max_steps UNTIL_STOPPED or more)
# take one optimizer step at most every PACED_STEP_SECONDS (tests/paced/, on the jobs' PYTHONPATH;
# the period in their run.toml's [env]): their steps past what a scenario looks at took the CPU
# the other tests needed.
PACED = REPO / "tests" / "paced"
PACED_STEP_SECONDS = 0.4
UNTIL_STOPPED = 100_000
GOLDEN = REPO / "tests" / "golden"

T = TypeVar("T")


# ---------------------------------------------------------------- running


def jobgen(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user would run it."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [str(VENV_BIN / "jobgen"), *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"jobgen {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def python_checks(code: str, timeout: float = 300) -> None:
    """Runs ``code``'s asserts in a fresh interpreter (what a user's own process loads from
    an exported model, with nothing this test imported); fails with its traceback."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def jobgen_as(user: str, args: list[str], out: Path) -> tuple[int, str]:
    """`jobgen ARGS` as ``user``: exit code and everything it printed (a traceback too, in
    ``out``). Forked, not exec'd: this machine's Python lives under /root, closed to other
    users; the code that runs is the same."""
    entry = pwd.getpwnam(user)
    # everything imported before the uid changes
    for module in ("jobgen.cli.main", "jobgen.spec.loader", "jobgen.runs.rundir"):
        importlib.import_module(module)
    with out.open("w") as sink:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(sink.fileno(), 1)
                os.dup2(sink.fileno(), 2)
                sys.stdout = sys.stderr = os.fdopen(1, "w", buffering=1)
                os.setgroups([entry.pw_gid])
                os.setgid(entry.pw_gid)
                os.setuid(entry.pw_uid)
                os.umask(0o022)
                from jobgen.cli.main import main

                try:
                    main(args, standalone_mode=False)
                    code = 0
                except SystemExit as exc:
                    code = int(exc.code or 0)
            except BaseException:  # noqa: BLE001 - the forked child must reach os._exit, whatever happened
                traceback.print_exc()  # what the console script would show
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status), out.read_text()


def torchrun(
    run_dir: Path,
    *,
    nproc: int = 2,
    expected: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    background: bool = False,
):
    """``torchrun --standalone -m trainer`` on this machine, gloo on CPU: a CompletedProcess, or
    with ``background`` a Popen whose stdout carries stderr too."""
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainer",
        "--run-dir",
        str(run_dir),
        "--expected-world-size",
        str(expected or nproc),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **(env or {})}
    if background:
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)


def torchrun_many(run_dirs: list[Path], *, nproc: int = 2, timeout: float = 900):
    """Every one of ``run_dirs`` trained in turn by one ``torchrun --standalone`` of
    tests/run_many.py (gloo on CPU): one start-up of torch for all of them. A CompletedProcess;
    each run's metrics.json says how it ended."""
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(REPO / "tests" / "run_many.py")]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [*cmd, *map(str, run_dirs)], env=full_env, capture_output=True, text=True, timeout=timeout, check=False
    )


def stopped_by_kill_switch(
    run_dir: Path, step: int, *, nproc: int = 2, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """Trains ``run_dir`` until ``step`` is logged, sets the kill switch, waits for the exit and
    clears the switch again (the run can resume): the run's summary and torchrun's output."""
    proc = torchrun(run_dir, nproc=nproc, env=env, background=True)
    wait_for_step(run_dir, proc, step)
    (run_dir / "switches" / "kill").touch()
    out, _ = proc.communicate(timeout=180)
    (run_dir / "switches" / "kill").unlink()
    return summary(run_dir), out


def llama(*, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, tie: bool = False, **config: Any):
    """A randomly initialised Llama of these dimensions (transformers' own class), in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers)
    heads_ = dict(num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tie)
    return LlamaForCausalLM(LlamaConfig(**shape, **heads_, **config)).float()


# ---------------------------------------------------------------- writing a run spec


def write_spec(directory: Path, body: str, name: str = "run.toml") -> Path:
    """``body`` (indented as it sits in the test) as ``directory/name``."""
    path = directory / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def _toml(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):  # of inline tables too (data.sources)
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, Path):
        value = str(value)
    return json.dumps(value)  # JSON strings, numbers, booleans and arrays are TOML as well


def _table(name: str, keys: dict[str, object]) -> list[str]:
    # None leaves a key out (a test's data={"path": None} drops make_run's default path).
    given = {key: value for key, value in keys.items() if value is not None}
    lines = [f"[{name}]", *(f"{key} = {_toml(value)}" for key, value in given.items() if not isinstance(value, dict))]
    for key, value in keys.items():
        if isinstance(value, dict):
            lines += _table(f"{name}.{key}", value)
    return lines


def run_spec(
    directory: Path,
    name: str,
    *,
    site: str | dict[str, object] = "local",
    extra: str = "",
    filename: str = "run.toml",
    **tables: dict[str, object] | None,
) -> Path:
    """A run.toml: ``site``, then ``[job]`` with ``name = NAME`` and the keys of ``job``, then
    the other tables in the order given (``model=``, ``data=``, ``train=``...). A dict value
    is a sub-table (``model={"lora": {"r": 4}}`` writes ``[model.lora]``), or an inline table
    in ``site``. ``extra`` is TOML text appended as written."""
    body = [f"site = {_toml(site)}"]
    for table, keys in {"job": {"name": name, **(tables.pop("job", None) or {})}, **tables}.items():
        if keys is not None:
            body += _table(table, keys)
    directory.mkdir(parents=True, exist_ok=True)
    return write_spec(directory, "\n".join(body) + "\n" + textwrap.dedent(extra).lstrip(), name=filename)


def doctor_spec(
    directory: Path,
    name: str = "doc",
    *,
    site: str | dict[str, object] = "local",
    extra: str = "",
    filename: str = "run.toml",
    **job: object,
) -> Path:
    """A node-health (``program = "doctor"``) run of 5 minutes with its runs under
    ``directory/runs``; ``job`` adds or overrides [job] keys."""
    return run_spec(
        directory,
        name,
        site=site,
        extra=extra,
        filename=filename,
        job={"program": "doctor", "time": "5m", "exit_grace": "1m", "runs_root": "runs", **job},
    )


# The trainer's own tests: a short run on this machine that reduces the loss in a few steps.
TRAINER_SETTINGS = {
    "max_steps": 12,
    "micro_batch_size": 4,
    "grad_accum": 2,
    "lr": 3e-3,
    "save_every_steps": 0,
    "log_every_steps": 1,
    "seed": 7,
    "warmup_steps": 2,
}


def shared_cache(site: str | dict[str, object]) -> dict[str, object] | str:
    """``site`` with the session's shared data cache (SHARED_DATA_CACHE_ENV), unless it names a
    data cache of its own or no shared one is set."""
    cache = os.environ.get(SHARED_DATA_CACHE_ENV)
    table = {"profile": site} if isinstance(site, str) else dict(site)
    paths = dict(table.get("paths") or {})
    if not cache or "data_cache" in paths:
        return site
    return {**table, "paths": {**paths, "data_cache": cache}}


def make_run(
    directory: Path,
    tiny_model: Path,
    name: str = "sft",
    *,
    model: dict[str, object] | None = None,
    data: dict[str, object] | None = None,
    eval: dict[str, object] | None = None,
    site: str | dict[str, object] = "local",
    procs: int | None = None,
    **train: object,
) -> Path:
    """A run directory as ``jobgen submit`` writes it (spec ``directory/NAME.toml``, runs under
    ``directory/runs``), for ``torchrun``: the tiny model, the example data, TRAINER_SETTINGS
    overridden by ``train``; ``model``/``data`` add keys to those tables, ``eval`` writes [eval],
    ``site`` is the site profile or its overrides; ``procs``: job.procs_per_node, for a layout
    validate checks against the world (train.expert_parallel), on a site of as many CPUs."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    job: dict[str, object] = {"time": "1h", "runs_root": "runs"}
    if procs is not None:
        job["procs_per_node"] = procs
        site = {"profile": site, "slurm": {"cpus_per_node": procs}} if isinstance(site, str) else site
    spec_file = run_spec(
        directory,
        name,
        site=shared_cache(site),
        filename=f"{name}.toml",
        job=job,
        model={"path": tiny_model, **(model or {})},
        data={"path": DATA, "max_length": 256, **(data or {})},
        train=_batch_keys({**TRAINER_SETTINGS, **train}, train),
        eval=eval,
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run.path


def _batch_keys(settings: dict[str, object], given: dict[str, object]) -> dict[str, object]:
    """A test that sets train.global_batch_size derives grad_accum from it: the default
    grad_accum is left out (the spec refuses both)."""
    if "global_batch_size" in given and "grad_accum" not in given:
        return {k: v for k, v in settings.items() if k != "grad_accum"}
    return settings


class ClusterRun(NamedTuple):
    """A training run's spec file and its run directory (conftest's ``cluster_run``)."""

    spec: Path
    path: Path


# Job names of the training runs a test submitted: conftest cancels them after the test, so
# that a failed scenario does not leave its job training on the nodes the next one needs.
SUBMITTED_NAMES: list[str] = []


def train_spec(
    directory: Path,
    tiny_model: Path,
    name: str,
    *,
    nodes: int = 1,
    procs_per_node: int = 2,
    time_limit: str = "10m",
    grace: str = "1m",
    array: int = 1,
    runs_root: Path | None = None,
    site: str | dict[str, object] = "local",
    eval: dict[str, object] | None = None,
    job: dict[str, object] | None = None,
    data: dict[str, object] | None = None,
    pace: float = PACED_STEP_SECONDS,
    **train: object,
) -> Path:
    """A training run for the dev cluster (``directory/NAME.toml``) that trains until it is
    stopped (max_steps 1e6, its steps paced: ``pace`` seconds, PACED_STEP_SECONDS unless
    given); ``train`` overrides or adds [train] keys, ``eval`` writes [eval], ``job`` adds
    [job] keys (min_nodes, nodelist...), ``data`` [data] keys (packing...)."""
    SUBMITTED_NAMES.append(name)
    settings = {
        "micro_batch_size": 4,
        "grad_accum": 1,
        "lr": 1e-3,
        "max_steps": 1_000_000,
        "save_every_steps": 0,
        "log_every_steps": 1,
        "seed": 3,
        **train,
    }
    settings = _batch_keys(settings, train)
    return run_spec(
        directory,
        name,
        site=shared_cache(site),
        filename=f"{name}.toml",
        job={
            "nodes": nodes,
            "procs_per_node": procs_per_node,
            "time": time_limit,
            "exit_grace": grace,
            "array": array,
            "runs_root": runs_root or directory / "runs",
            **(job or {}),
        },
        model={"path": tiny_model},
        data={"path": DATA, "max_length": 256, **(data or {})},
        train=settings,
        eval=eval,
        env=paced(pace) if int(settings["max_steps"]) >= UNTIL_STOPPED else None,
    )


def paced(period: float = PACED_STEP_SECONDS) -> dict[str, object]:
    """[env] of a dev-cluster run whose steps are paced (tests/paced/sitecustomize.py)."""
    return {"PACED_STEP_SECONDS": str(period)}


def command_spec(
    directory: Path,
    name: str,
    script: Path,
    args: list[str],
    *,
    nodes: int,
    procs_per_node: int,
    array: int,
    **command: object,
) -> Path:
    """A ``program = "command"`` run of ``script`` for the dev cluster (``directory/NAME.toml``):
    2-minute tasks with a 50 s lead-time signal, its steps paced, ``command`` adds [command] keys."""
    SUBMITTED_NAMES.append(name)
    job = {"program": "command", "nodes": nodes, "procs_per_node": procs_per_node, "time": "2m"}
    job |= {"exit_grace": "50s", "array": array, "runs_root": directory / "runs"}
    return run_spec(
        directory,
        name,
        filename=f"{name}.toml",
        job=job,
        command={"script": str(script), "args": args, **command},
        env=paced(),
    )


def small_sweep(directory: Path, *, train: dict[str, object] | None = None) -> Path:
    """A sweep file for the unit tests (``directory/run.toml``): 2 points over train.lr, at
    most 2 at once, 3 tasks each, a model directory and one data row beside it (nothing is
    trained: the tests look at what submission writes)."""
    (directory / "model").mkdir(exist_ok=True)
    (directory / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    job = {"time": "2m", "exit_grace": "50s", "array": 3, "runs_root": "runs"}
    extra = '[sweep]\nmax_parallel = 2\n[sweep.grid]\n"train.lr" = [1e-3, 2e-3]\n'
    return run_spec(
        directory, "lrs", job=job, model={"path": "model"}, data={"path": "data.jsonl"}, train=train, extra=extra
    )


def check_shell(text: str, directory: Path, name: str = "check.sbatch") -> None:
    """``text`` as a bash script (``directory/name``) passes ``bash -n`` and shellcheck at
    style level; shellcheck missing is a failure, not a skip (.ci/run installs it)."""
    import shutil

    import pytest

    script = directory / name
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck); .ci/run installs it")
    proc = subprocess.run(
        ["shellcheck", "--shell=bash", "--severity=style", str(script)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout


def cancel_submitted() -> None:
    """``scancel`` every job of the runs ``train_spec`` wrote since the last call."""
    for name in SUBMITTED_NAMES:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, check=False)
    SUBMITTED_NAMES.clear()


# ---------------------------------------------------------------- reading what a run wrote


def losses(run: Path) -> dict[int, float]:
    """Step -> training loss, from metrics.jsonl (evaluation lines left out)."""
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r.get("event") != "eval"}


def metric(run: Path, name: str) -> dict[int, float]:
    """Step -> one training metric (grad_norm, step_target_tokens...), from metrics.jsonl."""
    return {r["step"]: r[name] for r in read_jsonl(run / "metrics.jsonl") if r.get("event") != "eval"}


def assert_same_training(run: Path, reference: Path, steps: int) -> None:
    """``run`` trained as ``reference`` did: steps 1..steps, every loss (float tolerance),
    gradient norm and target-token count."""
    import pytest

    curve, expected = losses(run), losses(reference)
    assert sorted(curve) == list(range(1, steps + 1)), sorted(curve)
    for step in curve:
        assert curve[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-5), (step, curve, expected)
    norms, expected_norms = metric(run, "grad_norm"), metric(reference, "grad_norm")
    for step in norms:
        assert norms[step] == pytest.approx(expected_norms[step], rel=1e-3), (step, norms, expected_norms)
    assert metric(run, "step_target_tokens") == metric(reference, "step_target_tokens")


def local_run(
    directory: Path,
    model: Path,
    procs: int,
    name: str,
    *,
    data: dict[str, object],
    eval: dict[str, object] | None = None,
    **train: object,
) -> Path:
    """A materialized run directory for ``torchrun`` on this machine (tests/distributed): the
    trainer's settings of TRAINER_SETTINGS overridden by ``train`` (grad_accum left to a
    global_batch_size given), float32 weights, ``data`` added to the data table, ``eval`` as
    [eval]."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    spec_file = run_spec(
        directory,
        name,
        site=shared_cache({"profile": "local", "slurm": {"cpus_per_node": 4}}),
        filename=f"{name}.toml",
        job={"time": "1h", "runs_root": "runs", "procs_per_node": procs},
        model={"path": model, "dtype": "float32"},
        data={"path": DATA, **data},
        train=_batch_keys({**TRAINER_SETTINGS, **train}, train),
        eval=eval,
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run.path


def trained_locally(run: Path, procs: int) -> str:
    """torchrun's output of ``run`` on ``procs`` local processes, which must end with 0."""
    proc = torchrun(run, nproc=procs, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def eval_losses(run: Path) -> dict[int, float]:
    """Step -> eval loss, from metrics.jsonl's evaluation lines (the last one of a step)."""
    return {r["step"]: r["eval_loss"] for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "eval"}


def last_step(run: Path, job_id: int | None = None, restart: int | None = None) -> int:
    """The newest step in metrics.jsonl (of one job, or one attempt of it); 0 before the first."""
    steps = [
        r["step"]
        for r in read_jsonl(run / "metrics.jsonl")
        if (job_id is None or r["job_id"] == str(job_id)) and (restart is None or r.get("restart", 0) == restart)
    ]
    return max(steps, default=0)


def _task_event(run: Path, event: str, job_id: int, restart: int) -> dict[str, Any] | None:
    for r in read_jsonl(run / "tasks.jsonl"):
        if r["event"] == event and r["job_id"] == str(job_id) and r.get("restart", 0) == restart:
            return r
    return None


def first_step_record(run: Path, job_id: int, restart: int = 0) -> dict[str, Any] | None:
    """The ``first_step`` line of tasks.jsonl of that attempt of that job, if it trained."""
    return _task_event(run, "first_step", job_id, restart)


def exit_record(run: Path, job_id: int, restart: int = 0) -> dict[str, Any] | None:
    """The ``exit`` line of tasks.jsonl of that attempt of that job, if it left on its own."""
    return _task_event(run, "exit", job_id, restart)


def summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "metrics.json").read_text())


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step-*"))


def task_event(run: Path, array_task: int, event: str) -> dict | None:
    """The ``first_step`` or ``exit`` line of tasks.jsonl of one array task."""
    for record in read_jsonl(run / "tasks.jsonl"):
        if record.get("array_task") == str(array_task) and record["event"] == event:
            return record
    return None


def status(run: Path) -> dict[str, Any]:
    """``jobgen status RUN --json``."""
    return json.loads(jobgen("status", str(run), "--json", check=True).stdout)


# ---------------------------------------------------------------- waiting


def _output(process: subprocess.Popen) -> str:
    return "".join(stream.read() or "" for stream in (process.stdout, process.stderr) if stream is not None)


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    what: str | Callable[[], str],
    *,
    interval: float = 0.5,
    process: subprocess.Popen | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that. AssertionError
    naming ``what`` (a callable is asked at that moment) after ``timeout`` seconds, or as soon
    as ``process``, which the condition depends on, has exited without meeting it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            value = predicate()  # it may have met the condition just before it exited
            if value:
                return value
            detail = what() if callable(what) else what
            raise AssertionError(f"exited {process.returncode} before {detail}:\n{_output(process)[-5000:]}")
        if time.monotonic() >= deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {detail}")
        time.sleep(interval)


def wait_for_step(run: Path, process: subprocess.Popen, step: int, timeout: float = 180) -> None:
    """Until the trainer ``process`` has logged ``step`` (polled often: a stop requested right
    after must find the run early)."""
    wait_for(lambda: last_step(run) >= step, timeout, f"step {step} in {run}", interval=0.05, process=process)


def wait_until_gone(job_ids: list[int], timeout: float = 180) -> None:
    """Until Slurm has none of these jobs (or their array tasks) queued or running."""
    from jobgen.slurm import client as slurm

    wait_for(
        lambda: not slurm.queue(job_ids),
        timeout,
        lambda: f"jobs {job_ids} to leave the queue: {slurm.queue(job_ids)}",
        interval=1,
    )


# ---------------------------------------------------------------- the dev cluster


def submitted_job_id(stdout: str) -> int:
    """The job id `jobgen submit` / `jobgen doctor` printed."""
    match = re.search(r"submitted (?:doctor )?job (\d+)", stdout)
    assert match, stdout
    return int(match.group(1))


def submit(spec: Path, *args: str) -> int:
    """``jobgen submit SPEC ARGS``: the job id."""
    return submitted_job_id(jobgen("submit", str(spec), *args, check=True).stdout)


def running_task(array_job_id: int, index: int, timeout: float = 120) -> int:
    """The job id of array task ``index`` once it runs."""
    from jobgen.slurm import client as slurm

    def find() -> int | None:
        for entry in slurm.queue([array_job_id]):
            if entry.array_task == str(index) and entry.state == "RUNNING":
                return entry.job_id
        return None

    return wait_for(find, timeout, f"array task {array_job_id}_{index} to run")


def stopped_at_lead_time_then_finished(run: Path, job: int, stop_after: int, max_steps: int) -> dict[str, Any]:
    """Task 1 of the array ``job`` trains to step ``stop_after`` and gets what Slurm's
    ``--signal=B:USR1@...`` sends the batch shell before a time limit: it saves and stops
    (SIGNALLED, before ``max_steps``), and task 2 resumes and finishes. Task 1's exit record."""
    from jobgen.base.exit_codes import ExitCode
    from jobgen.runs.rundir import RunDir
    from jobgen.slurm import client as slurm

    task = running_task(job, 1, timeout=240)
    # The workers wait (SIGSTOP) while the signal travels (scancel, slurmctld, slurmd, the batch
    # shell's trap, its stop request): a tiny model's remaining steps take less than that trip
    # on an idle machine (the CI of 9b09b09 saw HSDP finish all 12 steps first). They are found
    # before the step is reached, so that nothing but the signal lies between: a loaded machine
    # took longer over pgrep than the last five steps of a context-parallel run.
    paused: list[int] = []
    found_training = [False]

    def reached() -> bool:
        step = last_step(run, task)
        if step < 1 or not found_training[0]:  # every rank exists once one step is done
            paused[:] = worker_pids(run)
            found_training[0] = step >= 1
        return step >= stop_after

    wait_for(reached, 240, f"step {stop_after}", interval=0.05)
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    paused += [pid for pid in worker_pids(run) if pid not in paused]  # none, unless a rank restarted
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        slurm.cancel(f"{job}_1", signal="USR1", batch_only=True)
        request = RunDir(run).stop_request(str(task), 0)  # what the batch shell's trap leaves
        wait_for(request.exists, 60, "the batch shell to leave the stop request", interval=0.1)
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    first = wait_for(lambda: exit_record(run, task), 180, "task 1 to save and stop")
    assert first["exit_code"] == ExitCode.SIGNALLED and first["end_step"] < max_steps, first
    wait_for(lambda: (run / "done").exists(), 300, "task 2 to resume and finish")
    return first


def stop_run(run: Path, job_ids: list[int], timeout: float = 240) -> None:
    """The kill switch, then until the jobs have left the queue."""
    (run / "switches" / "kill").touch()
    wait_until_gone(job_ids, timeout=timeout)


def kill_node(node: str) -> None:
    """A dev-cluster node dies: its slurmd, its slurmstepds and every process in its network
    namespace (the cluster's --netns mode)."""
    from jobgen.devcluster.netns import ns_name

    pids = subprocess.run(["ip", "netns", "pids", ns_name(node)], capture_output=True, text=True, check=True)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def revive_node(cluster: Any, node: str) -> None:
    """Bring a node :func:`kill_node` killed back into ``cluster`` (the session fixture's, in
    its shape), and return it to service."""
    from jobgen import devcluster

    gpus = [cluster.gpus.get(n, 0) for n in cluster.nodes]
    devcluster.up(
        nodes=len(cluster.nodes),
        cpus_per_node=cluster.cpus_per_node,
        netns=True,
        state_dir=cluster.state_dir,
        gpus=gpus,
        slurm=cluster.slurm,
    )
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)


def worker_pids(run: Path) -> list[int]:
    """The trainer processes of the run on this machine (every node of the dev cluster is on it)."""
    # Workers run as `python -u -m trainer ...`; torchrun's own command line has no "-u".
    out = subprocess.run(
        ["pgrep", "-f", "--", f"-u -m trainer --run-dir {run} "], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]


# ---------------------------------------------------------------- alert receivers


class _Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append({"type": self.headers["Content-Type"], **json.loads(body)})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def local_receivers(host: str):
    """A local SMTP server (aiosmtpd) and a local webhook (HTTP) server on ``host``;
    yields their ports and the lists of what they received."""
    from aiosmtpd.controller import Controller

    mails: list[dict] = []

    class Handler:
        async def handle_DATA(self, server, session, envelope):
            mails.append({"to": envelope.rcpt_tos, "data": envelope.content.decode(errors="replace")})
            return "250 OK"

    with socket.socket() as probe:  # aiosmtpd wants a port number, not 0
        probe.bind((host, 0))
        smtp_port = probe.getsockname()[1]
    smtp = Controller(Handler(), hostname=host, port=smtp_port)
    smtp.start()
    _Hook.received = []
    http = ThreadingHTTPServer((host, 0), _Hook)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield {"smtp_port": smtp_port, "http_port": http.server_address[1], "mails": mails, "posts": _Hook.received}
    finally:
        smtp.stop()
        http.shutdown()


def checkpoint_tensors(checkpoint: Path, prefix: str = "model.") -> dict:
    """Every tensor of the checkpoint under ``prefix``, read with DCP as the trainer wrote it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefix)}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return {k.removeprefix(prefix): v for k, v in state.items()}


def cut_short_and_extend(run: Path, checkpoint: str, max_steps: int) -> None:
    """A finished run asked for more steps, its ``checkpoint`` cut short (a third of its first
    shard): the next start must fall back to the previous one."""
    (run / "done").unlink()
    shard = sorted((run / "checkpoints" / checkpoint).glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["train"]["max_steps"] = max_steps
    (run / "spec.json").write_text(json.dumps(spec))


def spec_issues(path: Path) -> dict[str, str]:
    """Key -> message of every problem ``load_run`` finds in the spec at ``path`` (it must find one)."""
    import pytest

    from jobgen.spec.loader import SpecError, load_run

    with pytest.raises(SpecError) as info:
        load_run(path)
    return {i.key: i.message for i in info.value.issues}


def node(k: int) -> str:
    """The name of the k-th node (1-based) of this worker's dev cluster: node1 on the machine's
    first cluster, node101 on the second (jobgen.devcluster.instances)."""
    from jobgen import devcluster

    info = devcluster.status()
    assert info is not None, "no dev cluster is up for this worker"
    return info.nodes[k - 1]


def node_range(first: int, last: int) -> str:
    """Slurm's hostlist of nodes ``first..last`` of this worker's dev cluster: node[1-2]."""
    low, high = node(first).removeprefix("node"), node(last).removeprefix("node")
    return f"node[{low}-{high}]"


# ---------------------------------------------------------------- planted faults


def fault_dir(tmp_path: Path, code: str) -> Path:
    """A ``sitecustomize`` that every Python process started with it on PYTHONPATH runs
    first: how a test injects a fault into one rank without touching the trainer."""
    directory = tmp_path / "fault"
    directory.mkdir(exist_ok=True)
    (directory / "sitecustomize.py").write_text(textwrap.dedent(code))
    return directory


# A sitecustomize (fault_dir) for the tests of failures that repeat: every worker (torchrun sets
# RANK; its agent has none) crashes in its CRASH_AT-th optimizer step (CRASH_KIND=key: another
# exception), or while building the model with CRASH_BUILD (code: an error of the code; io: of
# the world); rank HANG_RANK (default 1) hangs in its HANG_AT-th optimizer step.
PLANTED_CRASHES = textwrap.dedent(
    """
    import os

    # CRASH_LAUNCH: only in that launch inside the task (JOBGEN_LAUNCH); unset, in every one.
    in_launch = os.environ.get("CRASH_LAUNCH") in (None, os.environ.get("JOBGEN_LAUNCH", "0"))
    if os.environ.get("RANK") is not None and os.environ.get("CRASH_AT") and in_launch:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        calls = []

        def crash(optimizer, args, kwargs):
            calls.append(1)
            if len(calls) == int(os.environ["CRASH_AT"]):
                if os.environ.get("CRASH_KIND") == "key":
                    raise KeyError("a planted crash of another kind")
                raise ValueError("a planted crash")

        register_optimizer_step_pre_hook(crash)

    if os.environ.get("RANK") == os.environ.get("HANG_RANK", "1") and os.environ.get("HANG_AT"):
        # Rank HANG_RANK stops answering in its HANG_AT-th optimizer step, in every launch: its
        # peers wait in the next collective (a hang at the same step each time).
        import time

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        hang_calls = []

        def hang(optimizer, args, kwargs):
            hang_calls.append(1)
            if len(hang_calls) == int(os.environ["HANG_AT"]):
                time.sleep(86400)

        register_optimizer_step_pre_hook(hang)

    if os.environ.get("RANK") is not None and os.environ.get("CRASH_BUILD"):
        # Building the model fails as GPT-2 under a pipeline did (an error of the code), or as a
        # file system may (an error of the world).
        import errno

        import transformers

        def load(*args, **kwargs):
            if os.environ["CRASH_BUILD"] == "io":
                raise OSError(errno.EIO, "a planted I/O error")
            raise AttributeError("'GPT2Config' object has no attribute 'intermediate_size'")

        transformers.AutoModelForCausalLM.from_pretrained = load
    """
)


def script_supervisor(text: str) -> dict[str, Any]:
    """The settings a rendered batch script hands its supervisor (``python -m jobgen.job``)."""
    body = text.split("<<'SETTINGS' || true\n", 1)[1].split("\nSETTINGS\n", 1)[0]
    return json.loads(body)


@contextlib.contextmanager
def slurm_setting(key: str, value: str):
    """The dev cluster's slurm.conf with ``key=value`` for the block (``scontrol reconfigure``),
    restored after: each pytest worker has a cluster of its own, so no other test sees it."""
    from jobgen.slurm import client as slurm

    conf = Path(slurm.config()["SLURM_CONF"])
    text = conf.read_text()
    (line,) = [x for x in text.splitlines() if x.startswith(f"{key}=")]
    conf.write_text(text.replace(f"{line}\n", f"{key}={value}\n"))
    try:
        slurm.run(["scontrol", "reconfigure"])
        yield
    finally:
        conf.write_text(text)
        slurm.run(["scontrol", "reconfigure"])


def log_time(line: str) -> float:
    """When the batch script or its supervisor logged ``line`` (its log() stamps local time to the second)."""
    return time.mktime(time.strptime(line.split(" jobgen: ")[0], "%Y-%m-%dT%H:%M:%S"))


def task_indices(field: str) -> list[str]:
    """An array task field of Slurm's: ``2``, or ``[2-3%1]`` / ``2-3`` / ``[3,5-7]`` for tasks
    still held (pending, or cancelled while pending) as one record."""
    out = []
    for part in field.strip("[]").split("%")[0].split(","):
        first, _, last = part.partition("-")
        out += [str(i) for i in range(int(first), int(last or first) + 1)] if first.isdigit() else []
    return out


def array_task_records(array: int) -> dict[str, dict[str, str]]:
    """Every task of an array as sacct has it, by index: state (its first word), exit code and
    comment; tasks cancelled while pending (one ``ARRAY_[2-3%1]`` row) each under its own index."""
    out = subprocess.run(
        ["sacct", "-j", str(array), "-X", "-n", "-P", "-o", "JobID,State,ExitCode,Comment"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = [line.split("|", 3) for line in out.splitlines() if line]
    return expand_task_rows(
        [
            (job.partition("_")[2], {"state": st.split()[0], "exit": code, "comment": comment})
            for job, st, code, comment in rows
        ]
    )


def expand_task_rows(rows: list[tuple[str, dict[str, str]]]) -> dict[str, dict[str, str]]:
    """(task field, row) pairs by task index. A task's own row wins over a range row that names it:
    the array's record keeps the range its pending tasks had (``[3-4%1]``) after task 3 started."""
    found: dict[str, dict[str, str]] = {}
    for field, row in sorted(rows, key=lambda pair: not pair[0].isdigit()):
        for index in task_indices(field):
            found.setdefault(index, row)
    return found


def assert_cancelled(array: int, indices: list[str], why: str) -> None:
    """Issue 47: a run that ended (finished, or failed for good) cancels its array's pending tasks,
    each with the reason as its comment: they never take the nodes from the queue only to exit."""
    rows = wait_for(
        lambda: (r := array_task_records(array)) and all(i in r for i in indices) and r,
        60,
        lambda: f"sacct to know tasks {indices} of {array}: {array_task_records(array)}",
    )
    for index in indices:
        row = rows[index]
        assert row["state"] == "CANCELLED" and row["comment"].startswith(f"jobgen: cancelled: {why}"), (index, rows)


def ran_tasks(run: Path, array: int) -> list[str]:
    """The indices of the array's tasks that started (their task records), in order."""
    records = (json.loads(p.read_text()) for p in run.glob("logs/task.*.json"))
    return sorted((r["array_task"] for r in records if r.get("array_job_id") == str(array)), key=int)
