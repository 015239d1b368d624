"""``jobgen serve`` against careless and hostile input (issue 30), without a cluster.

The server never opens itself beyond the cluster's network by accident: every spelling of a
wildcard or public address is refused unless ``serve.expose`` (which needs an API key), at
validate and again on the node, where host names resolve; ``serve.args`` cannot set where it
listens or its key. The key comes from the submitting shell by name and reaches both engines
(vLLM as VLLM_API_KEY, transformers behind jobgen's key proxy) and ``jobgen chat``, and is
written nowhere. ``--stop`` signals only the process jobgen started; every serve command acts
on the directory it was given; damaged records and odd paths are one line, never a traceback.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from helpers import DATA, VENV_BIN, jobgen, run_spec, wait_for
from jobgen.runs.rundir import RunDir, checkpoint_name
from jobgen.serve import address as serve_address
from jobgen.serve.records import identity
from jobgen.serve.status import ServeStateError, read_address, serve_status, stop_serve
from jobgen.serve.submit import Target, serve_job, write_script
from jobgen.spec.loader import load_run
from jobgen.spec.tables.serve import numeric_address

KEY_NAME = "SERVE_API_KEY"
# What `jobgen serve` writes into the directory it serves.
SERVE_FILES = ("serve.sbatch", "serve-job.json", "serve.json", "logs/serve")


def serve_spec(directory: Path, serve: dict[str, object]) -> Path:
    return run_spec(
        directory,
        "llm",
        job={"time": "1h", "runs_root": "runs"},
        model={"path": "org/model"},
        data={"path": str(DATA)},
        serve=serve,
    )


def refusal(spec: Path, key: str) -> str:
    """`jobgen validate`'s one line for ``key`` (exit 2)."""
    proc = jobgen("validate", str(spec))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip().startswith(f"{spec}: {key}: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ---------------------------------------------------------------- where it listens


WILDCARDS = ["0", "00", "0.0", "0x0", "0.0.0.0", "::", "::0", "0:0:0:0:0:0:0:0", "[::]", "::ffff:0.0.0.0"]
PUBLIC = ["8.8.8.8", "0x08080808", "2001:4860:4860::8888"]


@pytest.mark.parametrize("host", WILDCARDS + PUBLIC)
def test_validate_refuses_every_spelling_of_a_wildcard_or_public_host(tmp_path: Path, host: str):
    line = refusal(serve_spec(tmp_path, {"host": host}), "serve.host")
    assert ("every interface" if host in WILDCARDS else "public (globally routable)") in line
    assert "serve.expose" in line


def test_addresses_are_read_as_the_os_reads_them():
    assert {str(numeric_address(h)) for h in WILDCARDS[:5]} == {"0.0.0.0"}
    assert {str(numeric_address(h)) for h in WILDCARDS[5:9]} == {"::"}
    assert str(numeric_address("127.1")) == "127.0.0.1" and str(numeric_address("0x7f.1")) == "127.0.0.1"
    assert numeric_address("node7") is None and numeric_address("gpu-017.cluster") is None


def test_private_hosts_and_names_validate_and_expose_needs_a_key(tmp_path: Path):
    for host in ("10.1.2.3", "127.1", "fd00::1", "node7", "localhost"):
        assert load_run(serve_spec(tmp_path / host, {"host": host})).run.serve.host == host
    exposed = {"host": "0x0", "expose": True, "api_key_env": KEY_NAME}
    assert load_run(serve_spec(tmp_path / "exposed", exposed)).run.serve.expose
    line = refusal(serve_spec(tmp_path / "keyless", {"host": "0.0.0.0", "expose": True}), "serve.expose")
    assert "needs serve.api_key_env" in line
    # A name jobgen does not take for a secret's may be recorded by value in repro/env.txt.
    line = refusal(serve_spec(tmp_path / "plain", {"api_key_env": "JOBGEN_SERVE"}), "serve.api_key_env")
    assert "does not look like a secret's name" in line


@pytest.mark.parametrize(
    "args, index, option",
    [
        (["--host", "0.0.0.0"], 0, "--host"),
        (["--host=0.0.0.0"], 0, "--host"),
        (["--max-model-len", "4096", "--port", "80"], 2, "--port"),
        (["--port=8000"], 0, "--port"),
        (["--api-key", "x"], 0, "--api-key"),
        (["--api_key=x"], 0, "--api-key"),  # vLLM reads '_' as '-'
        (["--ho", "0.0.0.0"], 0, "--host"),  # argparse takes a unique prefix
        (["--uds", "/tmp/s.sock"], 0, "--uds"),
    ],
)
def test_validate_refuses_engine_args_that_set_where_it_listens_or_its_key(tmp_path: Path, args, index, option):
    line = refusal(serve_spec(tmp_path, {"engine": "vllm", "args": args}), f"serve.args[{index}]")
    assert f"the engine's {option}, which jobgen sets" in line


def test_engine_args_that_set_neither_validate(tmp_path: Path):
    args = ["--max-model-len", "4096", "--api-server-count", "2", "--hf-overrides", "{}"]
    assert load_run(serve_spec(tmp_path, {"engine": "vllm", "args": args})).run.serve.args == args


def _fake_resolver(monkeypatch: pytest.MonkeyPatch, table: dict[str, list[str]]) -> None:
    """Names in ``table`` resolve to its addresses; everything else as the OS says."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        numeric = kwargs.get("flags", 0) & socket.AI_NUMERICHOST
        if host not in table or numeric:
            return real(host, port, *args, **kwargs)
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in table[host]
        ]

    monkeypatch.setattr(serve_address.socket, "getaddrinfo", getaddrinfo)


def test_the_node_resolves_a_name_and_checks_every_address_it_binds(monkeypatch: pytest.MonkeyPatch):
    table = {"evil": ["0.0.0.0"], "mixed": ["10.1.2.3", "::"], "pub": ["8.8.8.8"], "inside": ["10.1.2.3"]}
    _fake_resolver(monkeypatch, table)
    listen = serve_address.listen_address
    for host, words in (("evil", "every interface"), ("mixed", "every interface"), ("pub", "public"), ("0x0", "every")):
        with pytest.raises(
            serve_address.ServeNodeError, match=rf"^refusing to listen there: '{host} \(.*\)' is .*{words}"
        ):
            listen(host, None)
    assert listen("evil", None, expose=True) == "0.0.0.0"
    assert listen("inside", None) == "10.1.2.3"  # the address, not the name, goes to the engine
    assert listen("localhost", None) in ("127.0.0.1", "::1")
    with pytest.raises(serve_address.ServeNodeError, match=r"'nosuch\.invalid' does not resolve on node"):
        listen("nosuch.invalid", None)
    # The node's own address on the site's interface is checked too.
    monkeypatch.setattr(serve_address, "interface_address", lambda _name: "8.8.8.8")
    with pytest.raises(serve_address.ServeNodeError, match=r"8\.8\.8\.8, the address node .* has on interface 'eth0'"):
        listen(None, "eth0")


def test_with_a_key_both_engines_listen_on_the_socket_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from jobgen.serve import node as serve_node

    monkeypatch.setattr(serve_node, "engine_executable", lambda name: f"/opt/bin/{name}")
    common = {"model_dir": tmp_path, "model_name": "llm", "host": "10.1.2.3", "port": 8000, "dtype": "auto", "gpus": 1}
    vllm = serve_node.engine_command("vllm", socket_path="/tmp/s/engine.sock", extra=["--max-model-len", "9"], **common)
    assert vllm == [
        *("/opt/bin/vllm", "serve", str(tmp_path), "--served-model-name", "llm", "--uds", "/tmp/s/engine.sock"),
        *("--dtype", "auto", "--tensor-parallel-size", "1", "--max-model-len", "9"),
    ]
    transformers = serve_node.engine_command("transformers", socket_path="/tmp/s/engine.sock", **common)
    assert transformers == [
        *(sys.executable, "-m", "jobgen.serve.uds", "/tmp/s/engine.sock", "serve", "llm"),
        *("--dtype", "auto", "--device", "auto"),
    ]
    workdir = serve_node.private_workdir()
    try:
        assert (workdir.stat().st_mode & 0o777) == 0o700 and (workdir / "models").is_dir()
    finally:
        shutil.rmtree(workdir)


def _fake_engine(tmp_path: Path, body: str) -> tuple[Path, dict[str, str]]:
    """A stand-in `vllm` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "vllm"
    fake.write_text(body)
    fake.chmod(0o755)
    return fake, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def supervisor(state: Path, *options: str) -> list[str]:
    command = [str(VENV_BIN / "python"), "-m", "jobgen.serve.node", "--state-dir", str(state), "--job-id", "5"]
    command += ["--model-dir", str(state), "--model-name", "m", "--engine", "vllm", *options]
    return [*command, "--ready-timeout", "60", "--stop-grace", "2", "--"]


@pytest.mark.parametrize(
    "options, env, words",
    [
        (("--host", "0x0"), {}, "ERROR: refusing to listen there: '0x0 (0.0.0.0)' is every interface"),
        (("--host", "::0"), {}, "is every interface"),
        (("--interface", "lo", "--api-key-env", KEY_NAME), {KEY_NAME: ""}, f"${KEY_NAME} is not set in this job's"),
        (("--interface", "lo", "--api-key-env", KEY_NAME), {KEY_NAME: "short"}, "shorter than 16 characters"),
    ],
    ids=["0x0", "::0", "key unset", "key short"],
)
def test_the_supervisor_refuses_before_it_starts_anything(tmp_path: Path, options, env, words):
    marker = tmp_path / "started"
    _, path_env = _fake_engine(tmp_path, f"#!/bin/bash\ntouch {marker}\nexit 1\n")
    proc = subprocess.run(
        supervisor(tmp_path, *options), capture_output=True, text=True, timeout=60, env={**path_env, **env}
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert words in proc.stdout and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not marker.exists() and not (tmp_path / "serve.json").exists()


FAKE_VLLM = """#!{python}
# A stand-in vllm on --uds that, like vLLM, asks for VLLM_API_KEY on /v1 only (401 without it),
# lists its model there, and answers /invocations to anyone.
import json, os, socketserver, sys
from http.server import BaseHTTPRequestHandler
argv = sys.argv
path, name = argv[argv.index("--uds") + 1], argv[argv.index("--served-model-name") + 1]
key = os.environ["VLLM_API_KEY"]
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = not self.path.startswith("/v1") or self.headers.get("Authorization") == "Bearer " + key
        body = json.dumps({{"data": [{{"id": name}}]}} if ok else {{"error": "no key"}}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_POST = do_GET
    def log_message(self, *args):
        pass
class Server(socketserver.UnixStreamServer):
    def get_request(self):
        return self.socket.accept()[0], ("local", 0)
Server(path, Handler).serve_forever()
"""


def test_vllm_listens_behind_the_key_on_every_path_and_gets_it_by_environment(tmp_path: Path):
    """vLLM's own key covers /v1 and a few prefixes; /invocations and the rest stay open. With
    a key it listens on a private socket, and jobgen's proxy asks for the key on every path;
    vLLM gets the key as VLLM_API_KEY (it would not start without), never on its command line."""
    import psutil

    key = secrets.token_hex(16)
    fake, env = _fake_engine(tmp_path, FAKE_VLLM.format(python=sys.executable))
    command = supervisor(tmp_path, "--interface", "lo", "--api-key-env", KEY_NAME)
    proc = subprocess.Popen(command, env={**env, KEY_NAME: key}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        address = wait_for(lambda: read_address(RunDir(tmp_path)), 60, "serve.json", process=proc)
        assert address["api_key_env"] == KEY_NAME and key not in json.dumps(address)
        for path in ("/v1/models", "/invocations", "/pause"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"http://{address['address']}{path}", timeout=10)
            assert refused.value.code == 401, path
        asked = urllib.request.Request(f"{address['url']}/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(asked, timeout=10) as answer:  # vLLM checked the key again
            assert json.loads(answer.read())["data"] == [{"id": "m"}]
        engines = [p for p in psutil.process_iter(["cmdline"]) if str(fake) in " ".join(p.info["cmdline"] or [])]
        assert engines and not any(key in " ".join(p.info["cmdline"]) for p in engines)
        assert "--uds" in engines[0].info["cmdline"] and "--host" not in engines[0].info["cmdline"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert key not in proc.stdout.read().decode()


# ---------------------------------------------------------------- the key, end to end


def planted_run(directory: Path, serve: dict[str, object], model: Path | None = None) -> RunDir:
    """A run directory with checkpoint 1, and ``model`` as its export under served/ (what
    `jobgen serve` made earlier): serving it needs no training and no export."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize

    spec = load_run(serve_spec(directory, serve))
    run, _ = materialize(spec, render(spec), None)
    (run.checkpoints / checkpoint_name(1)).mkdir()
    if model is not None:
        shutil.copytree(model, run.served / checkpoint_name(1))
    return run


def _no_export(*_args):
    raise AssertionError("the export under served/ is reused")


@pytest.mark.torch
def test_a_copied_run_served_with_a_key_answers_only_with_it(tmp_path: Path, tiny_model: Path):
    """`jobgen serve COPY --local` with api_key_env: everything lands in the copy; the openai
    client gets 401 without the key and a completion with it; `jobgen chat` reads the key;
    `transformers serve` holds no TCP port (the key proxy does); the key is nowhere on disk."""
    import openai
    import psutil

    original = planted_run(tmp_path, {"engine": "transformers", "api_key_env": KEY_NAME}, tiny_model).path
    copy = Path(shutil.copytree(original, tmp_path / "copy"))
    key = secrets.token_hex(16)
    env = {**os.environ, KEY_NAME: key, "OMP_NUM_THREADS": "1"}
    command = [str(VENV_BIN / "jobgen"), "serve", str(copy), "--local"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        address = wait_for(lambda: read_address(RunDir(copy)), 120, "serve.json", process=server)
        assert (copy / "serve.sbatch").is_file() and list((copy / "logs" / "serve").glob("*.out"))
        assert not [
            n for n in ("serve.sbatch", "serve-job.json", "serve.json", "logs/serve") if (original / n).exists()
        ]
        status = json.loads(jobgen("serve", str(copy), "--status", "--json", env=env, check=True).stdout)
        assert status["state"] == "up" and status["path"] == str(copy)
        assert "no server has been started here" in jobgen("serve", str(original), "--status").stdout

        with pytest.raises(urllib.error.HTTPError) as refused:  # no key at all
            urllib.request.urlopen(f"{address['url']}/models", timeout=30)
        assert refused.value.code == 401
        for wrong in ("not-the-key", key[:-1]):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=address["url"], api_key=wrong, max_retries=0, timeout=30).models.list()
        client = openai.OpenAI(base_url=address["url"], api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=address["model"], messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
        )
        assert reply.choices[0].message.content
        streamed = client.completions.create(model=address["model"], prompt="hi", max_tokens=4, stream=True)
        assert len(list(streamed)) >= 1

        def chat(**extra: str) -> subprocess.CompletedProcess:
            argv = [str(VENV_BIN / "jobgen"), "chat", str(copy), "--max-tokens", "4"]
            return subprocess.run(argv, input="hello\n", capture_output=True, text=True, timeout=60, env=extra)

        chatted = chat(**env)
        assert chatted.returncode == 0 and chatted.stdout.strip(), chatted.stderr
        keyless = chat(**{k: v for k, v in env.items() if k != KEY_NAME})
        assert keyless.returncode == 1 and f"asks for the API key in ${KEY_NAME}" in keyless.stderr

        engine = psutil.Process(address["pid"])
        listening = [c for p in [engine, *engine.children(recursive=True)] for c in p.net_connections("tcp")]
        assert not [c for c in listening if c.status == psutil.CONN_LISTEN], listening
        assert not [p.pid for p in psutil.process_iter(["cmdline"]) if key in " ".join(p.info["cmdline"] or [])]
        stopped = jobgen("serve", str(copy), "--stop", check=True, timeout=90)
        assert stopped.stdout.startswith("stopped serve job")
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)
    output = server.stdout.read()
    assert "jobgen-serve: refused GET '/v1/models'" in output and key not in output
    written = [p for p in copy.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert not written, written


def test_a_serve_spec_with_a_key_is_refused_without_it_in_the_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    run = planted_run(tmp_path, {"engine": "transformers", "api_key_env": KEY_NAME})
    (run.served / checkpoint_name(1)).mkdir(parents=True)
    monkeypatch.delenv(KEY_NAME, raising=False)
    proc = jobgen("serve", str(run.path), "--local")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"serve.api_key_env: ${KEY_NAME} is not set in this shell" in proc.stderr
    assert not (run.path / "serve.sbatch").exists() and not run.serve_job.exists()


# ---------------------------------------------------------------- a planted spec, the real command


def test_serve_local_refuses_a_planted_wildcard_host_before_anything_starts(tmp_path: Path):
    """A teammate edits spec.json: `jobgen serve --local` reads it as input, and stops there."""
    run = planted_run(tmp_path, {"engine": "transformers"})
    (run.served / checkpoint_name(1)).mkdir(parents=True)
    (run.served / checkpoint_name(1) / "config.json").write_text("{}")
    spec = json.loads(run.spec_file.read_text())
    spec["run"]["serve"]["host"] = "0x0"
    run.spec_file.write_text(json.dumps(spec))
    proc = jobgen("serve", str(run.path), "--local", timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert f"cannot read {run.spec_file}: run.serve.host: '0x0 (0.0.0.0)' is every interface" in proc.stderr
    assert not [n for n in SERVE_FILES if (run.path / n).exists()]


# ---------------------------------------------------------------- --stop signals only what jobgen started


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def plant_job(directory: Path, **record: object) -> None:
    job = {"job_id": "7", "local": True, "host": socket.gethostname(), **record}
    (directory / "serve-job.json").write_text(json.dumps(job))


def test_stop_never_signals_a_process_it_cannot_prove_it_started(tmp_path: Path):
    model = model_dir(tmp_path / "model")
    script = str(model / "serve.sbatch")
    unrelated = subprocess.Popen(["sleep", "300"])
    try:
        real = identity(unrelated.pid)
        planted = {
            "no script": {"pid": unrelated.pid},
            "empty script": {"pid": unrelated.pid, "script": ""},
            "no start time": {"pid": unrelated.pid, "script": script},
            "another start time": {**real, "started": real["started"] - 1, "script": script},
            "another command": {**real, "script": script},
            "every process of the user": {**real, "pid": -1, "script": script},
        }
        for what, record in planted.items():
            plant_job(model, **record)
            proc = jobgen("serve", str(model), "--stop")
            assert proc.returncode == 0 and proc.stdout.count("\n") == 1, (what, proc.stdout, proc.stderr)
            assert "nothing was signalled" in proc.stdout, (what, proc.stdout)
            assert unrelated.poll() is None, f"{what}: the unrelated process was killed"
            assert jobgen("serve", str(model), "--status").returncode == 1, what  # not 'up'
    finally:
        unrelated.kill()
        unrelated.wait()


def test_stop_ends_its_own_script_and_not_from_a_copy_of_its_directory(tmp_path: Path):
    """A record that holds (pid, start time, boot, `bash DIR/serve.sbatch`) is stopped; the same
    record in a copy of DIR names another directory's script, and nothing is signalled there."""
    model = model_dir(tmp_path / "model")
    (model / "serve.sbatch").write_text("trap 'kill $!; exit 0' TERM\nsleep 300 &\nwait\n")
    script = subprocess.Popen(["bash", str(model / "serve.sbatch")])
    try:
        time.sleep(0.2)  # bash has set its trap
        plant_job(model, script=str(model / "serve.sbatch"), **identity(script.pid))
        copy = Path(shutil.copytree(model, tmp_path / "copy"))
        proc = jobgen("serve", str(copy), "--stop", check=True)
        assert proc.stdout.startswith(f"{copy}: no serve job to stop") and "not acted on here" in proc.stdout
        assert script.poll() is None
        status = jobgen("serve", str(copy), "--status")
        assert status.returncode == 1 and "no server has been started here" in status.stdout
        assert jobgen("serve", str(model), "--status").stdout.startswith(f"{model}: starting")  # no address yet
        proc = jobgen("serve", str(model), "--stop", check=True, timeout=90)
        assert proc.stdout.startswith("stopped serve job 7"), proc.stdout
        assert script.wait(timeout=30) == 0
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()


# ---------------------------------------------------------------- the directory it was given


def test_a_copied_run_is_served_from_the_copy(tmp_path: Path):
    """spec.json's run_dir is where the run was made; the serve job of a copy is the copy's."""
    original = planted_run(tmp_path, {"engine": "transformers"})
    (original.served / checkpoint_name(1)).mkdir(parents=True)
    copy = RunDir(Path(shutil.copytree(original.path, tmp_path / "moved")))
    job = serve_job(Target(copy, copy.load_spec()), export=_no_export)
    assert job.state_dir == copy.path and job.model_dir == copy.served / checkpoint_name(1)
    script = write_script(job)
    assert script == copy.path / "serve.sbatch" and not (original.path / "serve.sbatch").exists()
    text = script.read_text()
    assert f"RUN_DIR={copy.path}\n" in text and f"#SBATCH --chdir={copy.path}\n" in text
    assert f"#SBATCH --output={copy.path}/logs/serve/%j.out\n" in text


# ---------------------------------------------------------------- damaged files and odd paths


def test_a_path_with_a_newline_is_one_line(tmp_path: Path):
    model = model_dir(tmp_path / "tiny\nmodel")
    run = planted_run(tmp_path / "r", {"engine": "transformers"})
    odd_run = Path(shutil.copytree(run.path, tmp_path / "run\nx"))
    for target in (model, odd_run):
        proc = jobgen("serve", str(target), "--local", timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "its path holds a control character" in proc.stderr and "Traceback" not in proc.stderr
        assert not (target / "serve.sbatch").exists()


def test_a_file_named_served_is_one_line(tmp_path: Path):
    run = planted_run(tmp_path, {"engine": "transformers"})
    run.served.write_text("not a directory")
    proc = jobgen("serve", str(run.path), "--local", timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"cannot make {run.served}: File exists" in proc.stderr


DAMAGED = {
    "truncated": b'{"job_id": "7", "lo',
    "a list": b"[]",
    "a string": b'"7"',
    "nested": b"[" * 100_000,
    "not utf-8": b"\xff\xfe{}",
    "superscript id": '{"job_id": "²"}'.encode(),
    "huge id": b'{"job_id": 1e999}',
    "long id": b'{"job_id": "' + b"9" * 5000 + b'"}',
    "escapes": b'{"job_id": "\\u001b]0;pwned\\u0007"}',
}


@pytest.mark.parametrize("content", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_serve_job_record_is_one_error_naming_it(tmp_path: Path, content: bytes):
    state = RunDir(model_dir(tmp_path / "model"))
    state.serve_job.write_bytes(content)
    for look in (serve_status, stop_serve, read_address):
        if look is read_address:
            state.serve_address.write_bytes(content)
        with pytest.raises(ServeStateError, match="^" + re.escape(str(state.path)) + r"/serve(-job)?\.json ") as error:
            look(state)
        assert "\n" not in str(error.value) and "\x1b" not in str(error.value)


def test_damaged_records_through_the_commands(tmp_path: Path):
    state = RunDir(model_dir(tmp_path / "model"))
    state.serve_job.write_bytes(DAMAGED["nested"])
    for args in (("serve", "--status"), ("serve", "--stop"), ("chat",), ("serve",)):
        proc = jobgen(args[0], str(state.path), *args[1:], timeout=60)
        assert proc.returncode in (1, 2) and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert str(state.serve_job) in proc.stderr
    state.serve_job.unlink()
    state.serve_address.symlink_to("/dev/zero")  # read to its end, it would never end
    proc = jobgen("serve", str(state.path), "--status", timeout=60)
    assert proc.returncode == 1 and f"{state.serve_address} is unreadable: is a symbolic link" in proc.stdout
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- the key proxy


class _Upstream(BaseHTTPRequestHandler):
    """The engine behind the proxy: /stream sends server-sent events without a length, in
    pieces; anything else echoes what reached it."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for n in range(3):
                piece = f"data: {n}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        echo = json.dumps({"body": body.decode(), "auth": self.headers.get("Authorization")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(echo)))
        self.end_headers()
        self.wfile.write(echo)

    def log_message(self, *args):
        pass


def test_the_key_proxy_refuses_before_reading_and_relays_streams(tmp_path: Path):
    import socketserver
    import threading

    from jobgen.serve.proxy import KeyProxy

    class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

        def get_request(self):
            request, _ = super().get_request()
            return request, ("local", 0)

    key = secrets.token_hex(16)
    upstream_path = str(tmp_path / "engine.sock")
    proxy = KeyProxy(("127.0.0.1", 0), upstream_path, key)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"

    def post(path: str, key: str | None, body: bytes = b"{}", length: int | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=30)
        headers = {"Content-Length": str(len(body) if length is None else length)}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()

    try:
        assert post("/v1/models", key)[0] == 502  # no engine behind it yet
        upstream = UnixHTTPServer(upstream_path, _Upstream)
        threading.Thread(target=upstream.serve_forever, daemon=True).start()
        # A body announced as 10 GB and never sent: refused at once, not read.
        status, body = post("/v1/chat/completions", None, b"", length=10 << 30)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert post("/v1/models", key[:-1] + "x")[0] == 401
        status, body = post("/echo", key, b'{"prompt": "hi"}')
        assert status == 200 and json.loads(body) == {"body": '{"prompt": "hi"}', "auth": f"Bearer {key}"}
        assert post("/stream", key) == (200, b"data: 0\n\ndata: 1\n\ndata: 2\n\n")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/v1/models", timeout=30)
        assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
        upstream.shutdown()
        upstream.server_close()
    finally:
        proxy.shutdown()
        proxy.server_close()
