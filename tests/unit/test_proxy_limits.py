"""jobgen's API-key proxy (jobgen.serve.proxy) against the clients anyone on the cluster's
network may be (issue 45): idle and slow connections are closed and hold a bounded number of
threads, one connection beyond the bound is turned away by the accepting thread; a request's
framing is read once (two Content-Lengths, one with a Transfer-Encoding, a malformed one or
header: 400, and nothing reaches the engine); a body over the limit is refused before a byte of
it is read, without allocating its claimed size; a body is passed on in pieces; and the openai
client, as users run it, still gets answers, streamed ones as they come.

The proxy runs in this process against a fake engine on a Unix socket; clients connect over
loopback only. Every loop is bounded in count and time, every test by a pytest timeout. The
limits are the proxy's attributes (module constants by default), set small here to keep the
tests short.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import secrets
import select
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from bounded import bounded
from jobgen.serve.proxy import KeyProxy, bearer

KEY = secrets.token_hex(16)


class _Engine(BaseHTTPRequestHandler):
    """The model server behind the proxy: records each request as it arrives (before its
    body), then answers /v1/chat/completions as an OpenAI server does (streamed when asked,
    its first piece sent before it waits for the test's go-ahead) and anything else with the
    size and digest of the body it got."""

    protocol_version = "HTTP/1.1"
    server: _EngineServer

    def do_POST(self) -> None:
        self.server.seen.append((self.command, self.path))
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
        body = self.rfile.read(length)
        if self.path == "/v1/chat/completions":
            self._chat(json.loads(body))
            return
        self._send(200, {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()})

    do_GET = do_POST

    def _send(self, status: int, answer: dict) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chat(self, request: dict) -> None:
        words = ["heard ", f"{len(request['messages'][-1]['content'])} ", "characters"]
        base = {"id": "chatcmpl-1", "created": 1, "model": request["model"]}
        if not request.get("stream"):
            message = {"role": "assistant", "content": "".join(words)}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            self._send(200, {**base, "object": "chat.completion", "choices": [choice]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for n, word in enumerate(words):
            if n == 1:  # the first piece must reach the client while the rest is not written yet
                self.server.waited.append(self.server.go_on.wait(10))
            choice = {"index": 0, "delta": {"content": word}, "finish_reason": None}
            self._chunk(f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, text: str) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(text), text.encode()))
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


class _EngineServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str):
        self.path = path
        self.seen: list[tuple[str, str]] = []
        self.go_on = threading.Event()
        self.waited: list[bool] = []
        super().__init__(path, _Engine)

    def get_request(self):
        request, _ = super().get_request()
        return request, ("engine", 0)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[_EngineServer]:
    server = _EngineServer(str(tmp_path / "engine.sock"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def start_proxy() -> Iterator[Callable[..., int]]:
    """Starts a KeyProxy on a loopback port with the given limits set; its port."""
    started: list[KeyProxy] = []

    def start(upstream: str, **limits: float) -> int:
        proxy = KeyProxy(("127.0.0.1", 0), upstream, KEY)
        for name, value in limits.items():
            setattr(proxy, name, value)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        started.append(proxy)
        return proxy.server_address[1]

    yield start
    for proxy in started:
        proxy.shutdown()
        proxy.server_close()


def request(*headers: str, body: bytes = b"", path: str = "/echo", key: str = KEY) -> bytes:
    """A POST as bytes on the wire, with the key and ``headers`` as given (none added)."""
    lines = [f"POST {path} HTTP/1.1", "Host: proxy", f"Authorization: Bearer {key}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def answer_of(sock: socket.socket, seconds: float = 10) -> bytes:
    """What comes back on ``sock`` until the proxy closes it or ``seconds`` pass."""
    received = b""
    until = time.monotonic() + seconds
    try:
        while (left := until - time.monotonic()) > 0:
            sock.settimeout(left)
            piece = sock.recv(65536)
            if not piece:
                break
            received += piece
    except (TimeoutError, ConnectionError):
        pass
    return received


def head_of(sock: socket.socket) -> bytes:
    """An answer's status line and headers, read up to their blank line (at most 64 kB)."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 65536 and (piece := sock.recv(1)):
        head += piece
    return head


def status_of(answer: bytes) -> int | None:
    """The status code an answer starts with; None for no answer at all."""
    return int(answer.split(b" ", 2)[1]) if answer else None


def exchange(port: int, data: bytes, seconds: float = 10) -> int | None:
    """Sends ``data`` on a new connection; the status of the answer, None if closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
        try:
            sock.sendall(data)
        except ConnectionError:
            return None
        return status_of(answer_of(sock, seconds))


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the proxy closes ``sock`` within ``seconds`` (what it says before is read and dropped)."""
    answer_of(sock, seconds)
    return _at_eof(sock)


def _at_eof(sock: socket.socket) -> bool:
    try:
        sock.settimeout(0.2)
        return sock.recv(1) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# ---------------------------------------------------------------- idle and slow connections


@pytest.mark.timeout(60)
def test_idle_connections_hold_a_bounded_number_of_threads_and_are_closed(engine, start_proxy):
    """40 connections that send nothing: at most ``max_connections`` threads, every one closed
    within the idle timeout (those beyond the bound at once), and the proxy answers after."""
    port = start_proxy(engine.path, idle_timeout=1.0, max_connections=8)
    before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(40):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.5)  # every connection accepted (and its thread started, if it got one)
        held = threading.active_count() - before
        assert held <= 8, f"{held} threads for 40 idle connections"
        opened = time.monotonic()
        still_open = [n for n, sock in enumerate(idle) if not closed_within(sock, 4.0)]
        assert not still_open, f"connections {still_open} still open after the 1 s idle timeout"
        assert time.monotonic() - opened < 8
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: threading.active_count() <= before, 5), "the idle connections' threads did not end"
    assert exchange(port, request("Content-Length: 2", body=b"hi")) == 200


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_client_that_drips_its_request_is_cut_off_at_the_deadline(engine, start_proxy, where: str):
    """One byte every 0.5 s never trips a 2 s idle timeout; the 3 s deadline for the whole
    request cuts it off (with a 408 once the body has begun)."""
    port = start_proxy(engine.path, idle_timeout=2.0, request_deadline=3.0)
    if where == "headers":
        start, drip = b"POST /echo HTTP/1.1\r\nX-Drip: ", b"a"
    else:
        start, drip = request("Content-Length: 1000"), b"{"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        began = time.monotonic()
        sock.sendall(start)
        cut, answer = None, b""
        for _ in range(24):  # 12 s at most
            readable, _, _ = select.select([sock], [], [], 0.5)
            if readable:
                answer = answer_of(sock, 2)
                cut = time.monotonic() - began
                break
            try:
                sock.sendall(drip)
            except ConnectionError:
                cut = time.monotonic() - began
                break
    assert cut is not None, f"a request dripped over 12 s was never cut off ({where})"
    assert 2.5 < cut < 6, cut
    assert status_of(answer) in ((None, 408) if where == "body" else (None,)), answer[:200]


@pytest.mark.timeout(60)
def test_a_connection_beyond_the_bound_is_turned_away_at_once(engine, start_proxy):
    """With ``max_connections`` held open, one more is answered 503 (or just closed) at once,
    not queued behind them; once they leave, requests are served again."""
    port = start_proxy(engine.path, idle_timeout=30.0, max_connections=4)
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
    try:
        time.sleep(0.5)
        began = time.monotonic()
        assert exchange(port, request("Content-Length: 0")) in (503, None)
        assert time.monotonic() - began < 3
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: exchange(port, request("Content-Length: 0"), seconds=2) == 200, 10)


@pytest.mark.timeout(60)
def test_the_deadline_runs_per_request_not_per_connection(engine, start_proxy):
    """A keep-alive connection that waits longer than the request deadline between two
    requests (but less than the idle timeout) is served each time."""
    port = start_proxy(engine.path, idle_timeout=5.0, request_deadline=1.0)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for n in range(3):
            conn.request("POST", "/echo", body=b"x" * n, headers=bearer(KEY))
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["size"] == n
            time.sleep(1.5)
    finally:
        conn.close()


# ---------------------------------------------------------------- framing and size


@pytest.mark.timeout(60)
def test_two_content_lengths_are_refused_and_nothing_reaches_the_engine(engine, start_proxy):
    """The proxy must not read a request's length one way and pass it on another: a body that
    holds a second request (smuggled past the key check) is refused whole."""
    port = start_proxy(engine.path)
    smuggled = b"GET /v1/smuggled HTTP/1.1\r\nHost: engine\r\n\r\n"
    status = exchange(port, request(f"Content-Length: {len(smuggled)}", "Content-Length: 0", body=smuggled))
    time.sleep(0.5)  # what the engine would have received has arrived by now
    assert (status, engine.seen) == (400, [])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        (["Content-Length: 5", "Content-Length: 5"], b"hello", 400),
        (["Content-Length: 5", "Transfer-Encoding: chunked"], b"5\r\nhello\r\n0\r\n\r\n", 400),
        (["Transfer-Encoding: chunked"], b"5\r\nhello\r\n0\r\n\r\n", 411),
        (["Content-Length: -5"], b"hello", 400),
        (["Content-Length: +5"], b"hello", 400),
        (["Content-Length: 0x5"], b"hello", 400),
        (["Content-Length: 5, 5"], b"hello", 400),
        (["Content-Length: 5_0"], b"hello", 400),
        (["Content-Length: \u00b2"], b"hi", 400),  # a superscript 2: str.isdigit() says yes
        (["X-Folded: a", " b", "Content-Length: 5"], b"hello", 400),
        (["Bad Name : x", "Content-Length: 5"], b"hello", 400),
        (["Content-Length: 1001"], b"x" * 1001, 413),
        (["Content-Length: " + "9" * 5000], b"", 413),
        (["Authorization: Bearer not-the-key", "Content-Length: 5"], b"hello", 401),
    ],
    ids=[
        "same-length-twice",
        "length-and-chunked",
        "chunked",
        "negative",
        "plus-sign",
        "hex",
        "list",
        "underscore",
        "superscript-digit",
        "folded-header",
        "malformed-header",
        "over-the-limit",
        "5000-digits",
        "second-authorization",
    ],
)
def test_a_request_framed_ambiguously_or_too_large_is_refused_before_the_engine(
    engine, start_proxy, headers: list[str], body: bytes, expected: int
):
    port = start_proxy(engine.path, max_body=1000)
    status = exchange(port, request(*headers, body=body))
    time.sleep(0.2)
    assert (status, engine.seen) == (expected, [])


@pytest.mark.timeout(60)
def test_a_huge_content_length_is_refused_without_allocating_it(engine):
    """A Content-Length of 10**11 with the key: 413 at once, in a process that could not
    allocate a tenth of it (RLIMIT_AS), instead of a MemoryError and a cut connection."""

    def ask() -> int | None:
        proxy = KeyProxy(("127.0.0.1", 0), engine.path, KEY)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        return exchange(proxy.server_address[1], request(f"Content-Length: {10**11}"), seconds=10)

    outcome = bounded(ask, seconds=30, extra_bytes=1 << 30)
    assert outcome.value == "413", outcome
    assert engine.seen == []


@pytest.mark.timeout(60)
def test_a_body_passes_in_pieces_up_to_the_limit(engine, start_proxy):
    """A body of several of the proxy's pieces, exactly the limit, reaches the engine whole."""
    port = start_proxy(engine.path, max_body=3 << 20)
    body = secrets.token_bytes(3 << 20)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/echo", body=body, headers=bearer(KEY))
        response = conn.getresponse()
        assert response.status == 200
        assert json.loads(response.read()) == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_100_continue_comes_only_after_the_checks(engine, start_proxy):
    """A client that waits for 100 Continue before its body (curl does, for large ones) hears
    the refusal instead when its key or length is wrong, and 100 Continue when all is well."""
    port = start_proxy(engine.path, max_body=1000)
    for key, length, first in [("not-the-key", 5, 401), (KEY, 1001, 413), (KEY, 5, 100)]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request("Expect: 100-continue", f"Content-Length: {length}", key=key))
            assert status_of(head_of(sock)) == first
            if first == 100:
                sock.sendall(b"hello")
                assert status_of(head_of(sock)) == 200
    assert engine.seen == [("POST", "/echo")]


# ---------------------------------------------------------------- as users use it


@pytest.mark.timeout(60)
def test_the_openai_client_gets_answers_whole_and_streamed(engine, start_proxy):
    """The openai client, as `jobgen chat` and users run it: a 3 MiB message answered whole, a
    streamed answer whose first piece arrives before the engine writes the rest, and the
    client's AuthenticationError for a wrong key."""
    import openai

    port = start_proxy(engine.path)
    url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
    big = "x" * (3 << 20)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": big}])
    assert reply.choices[0].message.content == f"heard {len(big)} characters"

    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            engine.go_on.set()
    assert pieces == ["heard ", "2 ", "characters"]
    assert engine.waited == [True], "the first piece reached the client only after the engine finished"

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="not-the-key", max_retries=0, timeout=30).models.list()
