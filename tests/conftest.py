"""Shared fixtures.

Slurm behaviour is tested on the real dev cluster (``jobgen cluster up --netns``),
started once per session by the ``cluster`` fixture when a test asks for it and
taken down again at the end if this session started it. Golden files are
regenerated only with ``pytest --update-golden``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the current templates")


@pytest.fixture(scope="session")
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing in the test suite may reach a model or dataset hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def write_spec(directory: Path, body: str, name: str = "run.toml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def jobgen(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300,
           check: bool = False) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user would run it."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([str(VENV_BIN / "jobgen"), *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"jobgen {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def submitted_job_id(stdout: str) -> int:
    """The job id `jobgen submit` / `jobgen doctor` printed."""
    import re

    match = re.search(r"submitted (?:doctor )?job (\d+)", stdout)
    assert match, stdout
    return int(match.group(1))


def wait_until_gone(job_ids: list[int], timeout: float = 180) -> None:
    """Until Slurm has none of these jobs (or their array tasks) queued or running."""
    import time

    from jobgen import slurm

    deadline = time.monotonic() + timeout
    while slurm.queue(job_ids):
        assert time.monotonic() < deadline, f"jobs {job_ids} still queued after {timeout}s: {slurm.queue(job_ids)}"
        time.sleep(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`jobgen make-tiny-model` once per session: random tiny Llama + local tokenizer."""
    pytest.importorskip("transformers")
    from jobgen.tinymodel import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def cluster():
    """The dev cluster in --netns mode with 3 nodes; reused if one is already up."""
    if shutil.which("slurmctld") is None and os.geteuid() != 0:
        pytest.skip("the dev cluster needs root to install and start Slurm")
    from jobgen import devcluster

    info = devcluster.status()
    started = False
    if info is not None and (not info.netns or len(info.nodes) != 3 or info.cpus_per_node < 4):
        # e.g. the 2-node cluster examples/quickstart.sh leaves running: one cluster per
        # machine, so replace it with the shape these tests are written for.
        devcluster.down()
        info = None
    if info is None:
        info = devcluster.up(nodes=3, cpus_per_node=4, netns=True)
        started = True
    yield info
    if started and not os.environ.get("JOBGEN_KEEP_CLUSTER"):
        devcluster.down()


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
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
        async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's naming
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
