"""``jobgen serve`` and ``jobgen chat`` without a cluster: the [serve] table (errors named by
file and key through ``jobgen validate``), the checks against the site, what the node decides
(engine, address, the engine's command), the export reused under RUN/served/, the chat client
against a stand-in server, and ``jobgen serve DIR --local`` with the real ``transformers serve``.

The Slurm side (the job, its time limit, the OpenAI client's requests) is tests/cluster/test_serve_slurm.py.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from helpers import DATA, VENV_BIN, jobgen, run_spec, wait_for
from jobgen.runs.rundir import RunDir, checkpoint_name
from jobgen.serve import node as serve_node
from jobgen.serve.chat import Conversation, chat
from jobgen.serve.status import read_address
from jobgen.serve.submit import ServeError, Target, exported_model, serve_job
from jobgen.spec.loader import load_run

# ---------------------------------------------------------------- the [serve] table


def serve_spec(tmp_path: Path, serve: dict[str, object], site: str | dict[str, object] = "local") -> Path:
    return run_spec(
        tmp_path,
        "llm",
        site=site,
        job={"time": "1h", "runs_root": "runs"},
        model={"path": "org/model"},
        data={"path": str(DATA)},
        serve=serve,
    )


@pytest.mark.parametrize(
    "serve, key, words",
    [
        ({"engnie": "vllm"}, "serve.engnie", "Extra inputs are not permitted"),
        ({"engine": "tgi"}, "serve.engine", "'auto', 'transformers' or 'vllm'"),
        ({"time": "30"}, "serve.time", "has no unit"),
        ({"port": 80}, "serve.port", "privileged"),
        ({"port": 70000}, "serve.port", "less than or equal to 65535"),
        ({"host": "0.0.0.0"}, "serve.host", "every interface"),
        ({"host": "a b"}, "serve.host", "a space cannot be used"),
        ({"model_name": "org/model:weights.gguf"}, "serve.model_name", "':' cannot be used"),
        ({"args": ["--max-model-len", "4096"]}, "serve", "serve.engine = 'transformers' or 'vllm'"),
        ({"gpus": -1}, "serve.gpus", "greater than or equal to 0"),
        ({"mem": "lots"}, "serve.mem", "is not a Slurm memory size"),
    ],
)
def test_validate_names_the_file_and_the_serve_key(tmp_path: Path, serve, key, words):
    spec = serve_spec(tmp_path, serve)
    proc = jobgen("validate", str(spec))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line.strip() for line in proc.stderr.splitlines()]
    assert any(line.startswith(f"{spec}: {key}: ") and words in line for line in lines), proc.stderr


def test_a_serve_table_validates_and_defaults_apply(tmp_path: Path):
    spec = serve_spec(
        tmp_path,
        {"engine": "vllm", "time": "30m", "port": 8000, "host": "10.1.2.3", "args": ["--max-model-len", "4096"]},
    )
    assert jobgen("validate", str(spec)).returncode == 0
    serve = load_run(spec).run.serve
    assert (serve.engine, serve.time, serve.port, serve.host) == ("vllm", 1800, 8000, "10.1.2.3")
    assert serve.args == ["--max-model-len", "4096"]
    defaults = load_run(serve_spec(tmp_path / "plain", {})).run.serve
    assert (defaults.engine, defaults.time, defaults.port, defaults.host) == ("auto", 4 * 3600, 0, None)


def fake_run(tmp_path: Path, steps: tuple[int, ...] = (1, 2), serve: dict[str, object] | None = None) -> RunDir:
    """A run directory with empty checkpoint directories (enough for choosing one)."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize

    spec = load_run(serve_spec(tmp_path, serve or {}))
    run, _ = materialize(spec, render(spec), None)
    for step in steps:
        (run.checkpoints / checkpoint_name(step)).mkdir()
    return run


def test_serve_keys_are_checked_against_the_site(tmp_path: Path):
    def export(_run, checkpoint, target):
        target.mkdir()
        return checkpoint or "step-00000002"

    run = fake_run(tmp_path / "gpus", serve={"gpus": 1})
    with pytest.raises(ServeError, match=r"serve.gpus: 1 GPU\(s\) asked for, but the site 'local' has 0"):
        serve_job(Target(run, run.load_spec()), export=export)
    run = fake_run(tmp_path / "cpus", serve={"cpus": 3})
    with pytest.raises(ServeError, match=r"serve.cpus: 3 CPUs asked for, but the site 'local' has 2"):
        serve_job(Target(run, run.load_spec()), export=export)


# ---------------------------------------------------------------- choosing and exporting the checkpoint


def test_the_export_is_made_once_under_served_and_reused(tmp_path: Path):
    run = fake_run(tmp_path)
    calls: list[str | None] = []

    def export(_run, checkpoint, target):
        calls.append(checkpoint)
        assert not target.exists()  # the exporter gets a new directory of its own
        target.mkdir()
        (target / "config.json").write_text("{}")
        return checkpoint or "step-00000002"  # the newest that loads

    model_dir, name = exported_model(run, None, export)
    assert (name, model_dir) == ("step-00000002", run.served / "step-00000002")
    assert (model_dir / "config.json").is_file() and calls == [None]
    assert exported_model(run, None, export) == (model_dir, name) and calls == [None]  # reused
    assert exported_model(run, "step-00000001", export)[1] == "step-00000001" and calls == [None, "step-00000001"]
    assert sorted(p.name for p in run.served.iterdir()) == ["step-00000001", "step-00000002"]  # no staging left

    def failing(_run, _checkpoint, target):
        target.mkdir()
        raise ServeError("cannot export")

    (run.checkpoints / checkpoint_name(3)).mkdir()
    with pytest.raises(ServeError, match="cannot export"):
        exported_model(run, None, failing)
    assert sorted(p.name for p in run.served.iterdir()) == ["step-00000001", "step-00000002"]


def test_best_and_step_choose_the_checkpoint_or_say_what_is_missing(tmp_path: Path):
    run = fake_run(tmp_path)
    target = Target(run, run.load_spec())
    chosen: list[str | None] = []

    def export(_run, checkpoint, target_dir):
        chosen.append(checkpoint)
        target_dir.mkdir()
        return checkpoint or "step-00000002"

    with pytest.raises(ServeError, match=r"best\.json is missing or unreadable"):
        serve_job(target, export=export, best=True)
    with pytest.raises(ServeError, match=r"no checkpoint of step 7 \(complete ones: 1, 2\)"):
        serve_job(target, export=export, step=7)
    run.best_checkpoint.write_text("{not json")
    with pytest.raises(ServeError, match="missing or unreadable"):
        serve_job(target, export=export, best=True)
    run.best_checkpoint.write_text(json.dumps({"step": 1, "checkpoint": "step-00000001", "eval_loss": 1.5}))
    job = serve_job(target, export=export, best=True)
    assert (job.checkpoint, job.model_dir, job.model_name) == ("step-00000001", run.served / "step-00000001", "llm")
    job = serve_job(target, export=export, step=2, time_limit=120)
    assert job.checkpoint == "step-00000002" and job.serve.time == 120
    assert chosen == ["step-00000001", "step-00000002"]


def test_a_run_without_checkpoints_has_nothing_to_serve(tmp_path: Path):
    run = fake_run(tmp_path, steps=())
    with pytest.raises(ServeError, match="no complete checkpoint yet"):
        exported_model(run, None, lambda *_: pytest.fail("nothing to export"))


# ---------------------------------------------------------------- what the node decides


def test_the_address_is_the_interfaces_and_never_every_interface():
    assert serve_node.listen_address(None, "lo") == "127.0.0.1"
    assert serve_node.listen_address("10.1.2.3", "lo") == "10.1.2.3"
    with pytest.raises(serve_node.ServeNodeError, match="no IPv4 address on interface 'nosuch0'"):
        serve_node.listen_address(None, "nosuch0")
    with pytest.raises(serve_node.ServeNodeError, match="every interface"):
        serve_node.listen_address("0.0.0.0", None)
    port = serve_node.free_port("127.0.0.1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free indeed


def test_auto_picks_vllm_only_with_vllm_and_a_gpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(serve_node, "vllm_installed", lambda: True)
    monkeypatch.setattr(serve_node, "gpu_visible", lambda: True)
    assert serve_node.resolve_engine("auto", 1) == "vllm"
    assert serve_node.resolve_engine("auto", 0) == "transformers"  # a CPU job
    assert serve_node.resolve_engine("transformers", 1) == "transformers"
    monkeypatch.setattr(serve_node, "gpu_visible", lambda: False)
    assert serve_node.resolve_engine("auto", 1) == "transformers"
    monkeypatch.setattr(serve_node, "gpu_visible", lambda: True)
    monkeypatch.setattr(serve_node, "vllm_installed", lambda: False)
    assert serve_node.resolve_engine("auto", 1) == "transformers"


def test_engine_commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    model = tmp_path / "served" / "step-00000040"
    common = {"model_dir": model, "model_name": "team/llm", "host": "10.1.2.3", "port": 8000, "dtype": "auto"}
    command = serve_node.engine_command("transformers", gpus=0, extra=["--continuous-batching"], **common)
    assert command == [
        str(VENV_BIN / "transformers"),
        *("serve", "team/llm", "--host", "10.1.2.3", "--port", "8000", "--dtype", "auto", "--device", "cpu"),
        "--continuous-batching",
    ]
    monkeypatch.setattr(serve_node, "engine_executable", lambda name: f"/opt/bin/{name}")
    assert serve_node.engine_command("vllm", gpus=2, **common) == [
        *("/opt/bin/vllm", "serve", str(model), "--served-model-name", "team/llm"),
        *("--host", "10.1.2.3", "--port", "8000", "--dtype", "auto", "--tensor-parallel-size", "2"),
    ]
    monkeypatch.setattr(serve_node, "engine_executable", lambda name: None)
    with pytest.raises(serve_node.ServeNodeError, match="no 'vllm' command in this job's environment"):
        serve_node.engine_command("vllm", gpus=1, **common)
    # transformers serve answers to the name it was started with: a link named so, in its workdir.
    model.mkdir(parents=True)
    serve_node.name_link(tmp_path / "work", "team/llm", model)
    assert (tmp_path / "work" / "team" / "llm").resolve() == model.resolve()


def test_the_address_file_is_removed_by_its_own_job_only(tmp_path: Path):
    run = RunDir(tmp_path)
    serve_node.write_address(run, {"job_id": "7", "url": "http://x/v1"})
    assert not serve_node.remove_address(run, "8") and read_address(run) == {"job_id": "7", "url": "http://x/v1"}
    assert serve_node.remove_address(run, "7") and read_address(run) is None
    assert not list(tmp_path.glob(".serve.json.*"))  # written through a temporary file, renamed


# ---------------------------------------------------------------- the chat client


class _FakeServer(BaseHTTPRequestHandler):
    """/v1/chat/completions as transformers serve streams it (no [DONE]); a message 'refuse'
    gets a 400 with FastAPI's {"detail": ...}."""

    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if body["messages"][-1]["content"] == "refuse":
            payload = json.dumps({"detail": "Unexpected fields in the request"}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        turn = sum(1 for m in body["messages"] if m["role"] == "user")
        for delta in ({"role": "assistant"}, {"content": "reply "}, {"content": f"#{turn}"}, {}):
            chunk = {"choices": [{"index": 0, "delta": delta}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    _FakeServer.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


def test_chat_keeps_the_conversation_and_survives_a_refusal(fake_server: str):
    out, err = io.StringIO(), io.StringIO()
    conversation = Conversation(url=fake_server, model="llm", system="Be brief.", max_tokens=16, temperature=0)
    lines = ["hello\n", "refuse\n", "\n", "and then?\n", "/reset\n", "again\n", "/exit\n", "never sent\n"]
    assert chat(conversation, lines, out, err, prompt=False) == 0
    assert out.getvalue().splitlines() == ["reply #1", "", "reply #2", "(conversation reset)", "reply #1"]
    assert "refused the request (HTTP 400): Unexpected fields in the request" in err.getvalue()
    bodies = _FakeServer.bodies
    assert [b["messages"][-1]["content"] for b in bodies] == ["hello", "refuse", "and then?", "again"]
    assert bodies[2]["messages"] == [  # the refused turn left out, the rest kept in order
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "reply #1"},
        {"role": "user", "content": "and then?"},
    ]
    assert bodies[3]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "again"}]
    assert all(b["stream"] and b["model"] == "llm" and b["max_tokens"] == 16 and b["temperature"] == 0 for b in bodies)


def test_chat_ends_when_the_server_cannot_be_reached():
    port = serve_node.free_port("127.0.0.1")
    out, err = io.StringIO(), io.StringIO()
    conversation = Conversation(url=f"http://127.0.0.1:{port}/v1", model="llm", timeout=5)
    assert chat(conversation, ["hello\n", "more\n"], out, err, prompt=False) == 1
    assert "cannot reach the server" in err.getvalue()


def test_chat_and_status_without_a_server(tmp_path: Path, tiny_model: Path):
    proc = jobgen("chat", str(tiny_model))
    assert proc.returncode == 1 and "no server has been started here" in proc.stderr, proc.stderr
    proc = jobgen("serve", str(tiny_model), "--status")
    assert proc.returncode == 1 and "no server has been started here" in proc.stdout
    proc = jobgen("serve", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "nor a model directory" in proc.stderr
    proc = jobgen("serve", str(tiny_model), "--best")
    assert proc.returncode == 2 and "a model directory is served as it is" in proc.stderr


# ---------------------------------------------------------------- --local: the real server, no Slurm


@pytest.mark.torch
def test_local_serve_answers_then_stops_leaving_nothing(tmp_path: Path, tiny_model: Path):
    """`jobgen serve DIR --local`: the same script on this machine, on loopback; `--stop` ends it."""
    import shutil

    import psutil

    model = tmp_path / "tiny chat"  # a space: names and paths reach the script quoted
    shutil.copytree(tiny_model, model)
    state = RunDir(model)
    server = subprocess.Popen(
        [str(VENV_BIN / "jobgen"), "serve", str(model), "--local"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        address = wait_for(lambda: read_address(state), 120, "serve.json", process=server)
        assert address["host"] == "127.0.0.1" and address["model"] == "tiny-chat"
        assert address["engine"] == "transformers" and address["model_dir"] == str(model)
        status = json.loads(jobgen("serve", str(model), "--status", "--json", check=True).stdout)
        assert status["state"] == "up" and status["local"] and status["url"] == address["url"]
        with pytest.raises(AssertionError, match="already served"):
            jobgen("serve", str(model), check=True)
        chatted = subprocess.run(
            [str(VENV_BIN / "jobgen"), "chat", str(model), "--max-tokens", "4"],
            input="hello\n",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert chatted.returncode == 0 and chatted.stdout.strip(), chatted.stderr
        started = time.monotonic()
        stopped = jobgen("serve", str(model), "--stop", check=True, timeout=90)
        assert "is gone" in stopped.stdout
        assert server.wait(timeout=30) == 0
        assert time.monotonic() - started < 30
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)
    output = server.stdout.read()
    assert "received SIGTERM: stopping the server" in output, output
    assert read_address(state) is None
    # The supervisor names the model directory; the server, its own port.
    marks = (str(model), f"--port {address['port']}")
    left = [
        p.info
        for p in psutil.process_iter(["pid", "cmdline"])
        if any(m in " ".join(p.info["cmdline"] or []) for m in marks)
    ]
    assert not left, f"processes left behind: {left}"


@pytest.mark.parametrize(
    "body, words",
    [
        ("echo 'no GPU here' >&2; exit 1", "exited with status 1 before it answered"),
        ("sleep 317 & wait", "did not answer within serve.ready_timeout (2s): stopping it"),
    ],
    ids=["fails", "never answers"],
)
def test_a_server_that_never_answers_fails_the_job_and_leaves_nothing(tmp_path: Path, body: str, words: str):
    """The supervisor as the job runs it, with a stand-in `vllm` that exits or hangs: exit 3
    (launch error), no serve.json, and nothing of the server's process group left."""
    import psutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text(f"#!/bin/bash\n# marker {tmp_path}\n{body}\n")
    fake.chmod(0o755)
    command = [str(VENV_BIN / "python"), "-m", "jobgen.serve.node", "--state-dir", str(tmp_path), "--job-id", "5"]
    command += ["--model-dir", str(tmp_path), "--model-name", "m", "--engine", "vllm", "--interface", "lo"]
    command += ["--ready-timeout", "2", "--stop-grace", "2", "--"]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert words in proc.stdout and "server stopped" in proc.stdout, proc.stdout
    assert not (tmp_path / "serve.json").exists()
    marks = (str(fake), "sleep 317")  # the engine, and a child of it in its process group
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if " ".join(p.info["cmdline"] or []) in marks]
    left += [p.info for p in psutil.process_iter(["pid", "cmdline"]) if str(fake) in " ".join(p.info["cmdline"] or [])]
    assert not left, left
