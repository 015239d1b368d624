"""What runs on the serve job's node: the engine's server, its address file, its end.

    python -m jobgen.serve.node --state-dir RUN --job-id 123 --model-dir RUN/served/step-00000040 \\
        --model-name tiny-sft --engine auto --gpus 0 --interface eth0 --port 0 -- [engine args]

The serve job's script (jobgen.serve.render) starts it under srun, on the one node of the job.
It decides what only the node can know, then supervises a server that is not jobgen's:

- the engine: 'auto' is vLLM when vLLM is installed and a GPU is visible, else ``transformers
  serve``; the address: serve.host resolved here, else the node's IPv4 on the site's interface,
  never a wildcard or a public one without serve.expose (jobgen.serve.address); the port: a
  free one when the spec says 0; the API key (serve.api_key_env), read from the job's
  environment by name: vLLM checks it itself, transformers listens on a private socket behind
  jobgen's key proxy (jobgen.serve.proxy);
- the server starts in a session of its own, and ``/v1/models`` is polled until it lists the
  model; then ``serve.json`` (RunDir.serve_address) is written atomically: host, port, model,
  engine, job. Clients (``jobgen chat``, ``jobgen serve --status``) read it;
- SIGTERM, SIGINT or SIGHUP (Slurm's time limit, scancel, ``jobgen serve --stop``, Ctrl-C)
  stop the server's whole process group: TERM, then KILL after STOP_GRACE_SECONDS, which
  stays below Slurm's KillWait (30 s by default). ``serve.json`` goes with it, if it is still
  this job's.

It imports neither torch nor transformers: the engine runs as its own command.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jobgen.base.atomic import write_json_atomic
from jobgen.base.exit_codes import ExitCode
from jobgen.runs.rundir import RunDir
from jobgen.serve.address import ServeNodeError, api_key, free_port, listen_address, url_host
from jobgen.serve.proxy import KeyProxy, bearer
from jobgen.serve.records import RecordError, read_record

# Between the server's SIGTERM and its SIGKILL: below Slurm's default KillWait (30 s), so
# that this process, not slurmstepd, ends the server and removes the address file.
STOP_GRACE_SECONDS = 20.0
POLL_SECONDS = 0.5


def log(message: str) -> None:
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H:%M:%S")
    print(f"{stamp} jobgen-serve: {message}", flush=True)


# ---------------------------------------------------------------- decisions on the node


def gpu_visible() -> bool:
    """Whether this job sees a GPU (nvidia-smi lists one; Slurm sets CUDA_VISIBLE_DEVICES)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1", "NoDevFiles"):
        return False
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.startswith("GPU") for line in out.splitlines())


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None or engine_executable("vllm") is not None


def resolve_engine(requested: str, gpus: int) -> str:
    """The engine to run: as asked, or for 'auto' vLLM where it is installed and a GPU is
    there, else transformers (which also serves on CPU)."""
    if requested != "auto":
        return requested
    if gpus > 0 and vllm_installed() and gpu_visible():
        return "vllm"
    return "transformers"


def engine_executable(name: str) -> str | None:
    """The engine's console script: the one of this Python's environment first (the site's
    venv or container), then PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name)


def engine_command(
    engine: str,
    *,
    model_dir: Path,
    model_name: str,
    host: str,
    port: int,
    gpus: int,
    dtype: str,
    extra: Sequence[str] = (),
    socket_path: str | None = None,
) -> list[str]:
    """The engine's serve command as an argument list. ``transformers serve`` answers to the name
    of the model it was started with, a path: it runs where ``model_name`` is a link to the model
    directory (:func:`name_link`), so clients send the name, not the path. With ``socket_path``
    it listens there instead (vLLM's --uds; transformers through jobgen.serve.uds), behind the
    key proxy that holds host and port."""
    executable = engine_executable(engine)
    if executable is None:
        hint = "pip install 'jobgen[serve]'" if engine == "transformers" else "install vLLM for the site's CUDA"
        raise ServeNodeError(f"no '{engine}' command in this job's environment ({hint})")
    if engine == "vllm":
        command = [executable, "serve", str(model_dir), "--served-model-name", model_name]
        command += ["--host", host, "--port", str(port)] if socket_path is None else ["--uds", socket_path]
        command += ["--dtype", dtype, "--tensor-parallel-size", str(max(gpus, 1))]
    elif socket_path is not None:
        command = [sys.executable, "-m", "jobgen.serve.uds", socket_path, "serve", model_name, "--dtype", dtype]
        command += ["--device", "auto" if gpus else "cpu"]
    else:
        command = [executable, "serve", model_name, "--host", host, "--port", str(port), "--dtype", dtype]
        command += ["--device", "auto" if gpus else "cpu"]
    return [*command, *extra]


def name_link(workdir: Path, model_name: str, model_dir: Path) -> None:
    """``workdir/<model_name>`` → the model directory (a name with a '/' gets its parent)."""
    link = workdir / model_name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(model_dir.resolve(), target_is_directory=True)


def answers(base_url: str, model_name: str, timeout: float = 2.0, key: str | None = None) -> bool:
    """Whether the server lists the model on /v1/models (asked with ``key``, when it takes one)."""
    request = urllib.request.Request(f"{base_url}/models", headers=bearer(key) if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            listing = json.loads(response.read())
    except (OSError, ValueError):
        return False
    data = listing.get("data") if isinstance(listing, dict) else None
    return any(isinstance(m, dict) and m.get("id") == model_name for m in data or [])


def refuses_without_key(base_url: str, timeout: float = 2.0) -> bool:
    """Whether the server answers /v1/models with 401: it is up, and asks for a key."""
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=timeout):
            return False
    except urllib.error.HTTPError as exc:
        return exc.code == 401
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------- the address file


def write_address(run: RunDir, record: dict[str, object]) -> None:
    write_json_atomic(run.serve_address, record)


def remove_address(run: RunDir, job_id: str) -> bool:
    """Remove serve.json if this job wrote it; a newer job's file stays."""
    try:
        record = read_record(run.serve_address)
    except RecordError:
        return False
    if record is None or str(record.get("job_id")) != job_id:
        return False
    with contextlib.suppress(FileNotFoundError):
        run.serve_address.unlink()
    return True


# ---------------------------------------------------------------- supervision


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """TERM to the server's process group, KILL to whatever is left after ``grace``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log(f"server still running {grace:.0f}s after SIGTERM: SIGKILL")
    # The group may hold processes that outlive its leader (vLLM's workers): none stays.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class _Stop:
    """The signal that asked this process to stop, set by the handlers."""

    signal: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal = signal.Signals(signum).name


@dataclass
class Server:
    """The engine's process, and the key proxy in front of it (with serve.api_key_env)."""

    proc: subprocess.Popen
    proxy: KeyProxy | None = None

    def stop(self, grace: float) -> None:
        stop_group(self.proc, grace)
        if self.proxy is not None:
            self.proxy.shutdown()
            self.proxy.server_close()


def start_server(args: argparse.Namespace, engine: str, host: str, port: int, key: str | None, workdir: Path) -> Server:
    """The engine, started in a session of its own. With a key, it listens on a Unix socket in
    ``workdir`` (mode 0700: no other user of the node can open it) and jobgen's proxy holds host
    and port, asking for the key on every path: vLLM's own key covers /v1 and a few more
    prefixes only, and transformers has none. vLLM gets the key as well, as VLLM_API_KEY (an
    environment is not world-readable, a command line is)."""
    model_dir = Path(args.model_dir)
    if engine == "transformers":
        name_link(workdir / "models", args.model_name, model_dir)
    socket_path = str(workdir / "engine.sock") if key else None
    command = engine_command(
        engine,
        model_dir=model_dir,
        model_name=args.model_name,
        host=host,
        port=port,
        gpus=args.gpus,
        dtype=args.dtype,
        extra=args.extra,
        socket_path=socket_path,
    )
    env = {**os.environ, "VLLM_API_KEY": key} if key and engine == "vllm" else None
    proxy = None
    if socket_path is not None and key is not None:
        proxy = KeyProxy((host, port), socket_path, key)  # the port is held from now on
        threading.Thread(target=proxy.serve_forever, name="key-proxy", daemon=True).start()
        log(f"API key proxy on {url_host(host)}:{port} for {socket_path}")
    log(f"starting {engine}: {' '.join(command)}" + (f" (API key from ${args.api_key_env})" if key else ""))
    return Server(subprocess.Popen(command, cwd=workdir / "models", start_new_session=True, env=env), proxy)


def private_workdir() -> Path:
    """A directory of the supervisor's, mode 0700 (mkdtemp): the engine's socket there is no
    one else's to open. A Unix socket's path holds at most 107 bytes: under a long TMPDIR it
    goes under /tmp instead."""
    workdir = Path(tempfile.mkdtemp(prefix="jobgen-serve-"))
    if len(os.fsencode(workdir / "engine.sock")) > 100:
        shutil.rmtree(workdir, ignore_errors=True)
        workdir = Path(tempfile.mkdtemp(prefix="jobgen-serve-", dir="/tmp"))
    (workdir / "models").mkdir()
    return workdir


def supervise(args: argparse.Namespace) -> int:
    run = RunDir(Path(args.state_dir))
    stop = _Stop()
    stop.install()
    key = api_key(args.api_key_env)
    engine = resolve_engine(args.engine, args.gpus)
    host = listen_address(args.host, args.interface, expose=args.expose)
    port = args.port or free_port(host)
    base_url = f"http://{url_host(host)}:{port}/v1"
    workdir = private_workdir()
    server: Server | None = None
    try:
        server = start_server(args, engine, host, port, key, workdir)
        return watch(args, run, server, engine, host, port, base_url, key, stop)
    finally:
        if server is not None:
            server.stop(args.stop_grace)
        if remove_address(run, args.job_id):
            log(f"removed {run.serve_address}")
        shutil.rmtree(workdir, ignore_errors=True)
        log("server stopped")


def watch(
    args: argparse.Namespace,
    run: RunDir,
    server: Server,
    engine: str,
    host: str,
    port: int,
    base_url: str,
    key: str | None,
    stop: _Stop,
) -> int:
    """Until a signal: the address written once the server answers, its end if it exits."""
    started = time.monotonic()
    deadline = started + args.ready_timeout
    ready_at: float | None = None
    while stop.signal is None:
        code = server.proc.poll()
        if code is not None:
            if ready_at is None:
                log(f"the {engine} server exited with status {code} before it answered (its output is above)")
                return int(ExitCode.LAUNCH_ERROR)
            log(f"the {engine} server exited with status {code} on its own")
            return code or int(ExitCode.CRASHED)
        if ready_at is None and answers(base_url, args.model_name, key=key):
            ready_at = time.monotonic()
            record = _record(args, engine, host, port, base_url, server.proc.pid, ready_at - started)
            write_address(run, record)
            log(f"ready after {ready_at - started:.1f}s: model '{args.model_name}' at {base_url}")
        elif ready_at is None and time.monotonic() > deadline:
            log(f"the server did not answer within serve.ready_timeout ({args.ready_timeout:.0f}s): stopping it")
            return int(ExitCode.LAUNCH_ERROR)
        time.sleep(POLL_SECONDS)
    log(f"received {stop.signal}: stopping the server")
    return int(ExitCode.OK)


def _record(
    args: argparse.Namespace, engine: str, host: str, port: int, base_url: str, pid: int, ready_seconds: float
) -> dict[str, object]:
    return {
        "address": f"{url_host(host)}:{port}",
        "host": host,
        "port": port,
        "url": base_url,
        "model": args.model_name,
        "model_dir": args.model_dir,
        "checkpoint": args.checkpoint,
        "engine": engine,
        "job_id": args.job_id,
        # Slurm's name of the node: on the dev cluster every node shares this machine's hostname.
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0],
        "pid": pid,
        "ready_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "ready_seconds": round(ready_seconds, 1),
        # The variable's name only: clients (jobgen chat) read the key from their own environment.
        "api_key_env": args.api_key_env,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobgen.serve.node", description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", required=True, help="the run directory (or DIR) that gets serve.json")
    parser.add_argument("--job-id", required=True, help="this job's id, recorded in serve.json")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--model-name", required=True, help="the name clients send as 'model'")
    parser.add_argument("--checkpoint", default=None, help="the run's checkpoint the model was exported from")
    parser.add_argument("--engine", choices=("auto", "transformers", "vllm"), default="auto")
    parser.add_argument("--gpus", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--host", default=None, help="address to listen on (default: --interface's)")
    parser.add_argument("--interface", default=None, help="the site's network interface")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--expose", action="store_true", help="serve.expose: a wildcard or public address is allowed")
    parser.add_argument("--api-key-env", default=None, help="the NAME of the variable holding the API key")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the first answer")
    parser.add_argument("--stop-grace", type=float, default=STOP_GRACE_SECONDS)
    parser.add_argument("extra", nargs="*", help="after '--': arguments for the engine's serve command")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return supervise(args)
    except ServeNodeError as exc:
        log(f"ERROR: {exc}")
        return int(ExitCode.LAUNCH_ERROR)


if __name__ == "__main__":
    sys.exit(main())
