"""The API key in front of a server that has none: jobgen's own small HTTP proxy.

    proxy = KeyProxy(("10.1.2.3", 8000), "/tmp/jobgen-sock-x/engine.sock", key)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()

``transformers serve`` has no API key, and vLLM's covers only some paths (/v1, /v2,
/inference, ...; /invocations, /tokenize, /pause stay open). With ``[serve] api_key_env``
the engine listens on a Unix socket in a directory only the job's user can open (vLLM's
--uds; transformers through jobgen.serve.uds), and this proxy listens where the server would
have (serve.host, serve.port): each request, on every path, must carry ``Authorization:
Bearer <key>`` (what the ``openai`` client sends), else it gets OpenAI's 401 before its body
is read; an authorized one is passed to the socket (its Authorization too: vLLM checks the
key again), its body in pieces as they arrive, and the answer streamed back piece by piece
(server-sent events included). The key is compared in constant time and never logged.

Anyone on the cluster's network may connect before any key is checked, so what a client can
hold is bounded (issue 45):

- at most MAX_CONNECTIONS connections at once, a thread each; one more is answered 503 by the
  accepting thread and closed, with no thread started for it;
- a connection that sends nothing for IDLE_TIMEOUT_SECONDS is closed, and a request's line,
  headers and body must all arrive within REQUEST_DEADLINE_SECONDS of its first byte, so a
  client that sends a byte every few seconds is cut off too (with 408 once its body has begun).
  The engine's answer may take as long as it takes (UPSTREAM_TIMEOUT_SECONDS at most between
  two of its pieces);
- a request is framed one way only, the way it is passed on: no Transfer-Encoding (411: send a
  Content-Length), at most one Content-Length, of ASCII digits, one Authorization, no folded
  or malformed header line, else 400 with nothing sent to the engine: a proxy and a server that
  read a request's end differently let a second request hide in a body, past the key check;
- a body over MAX_BODY_BYTES is refused (413) before a byte of it is read, and a body is never
  held whole (CHUNK bytes at a time), so a claimed length costs no memory.

Standard library only: it runs in the supervisor (jobgen.serve.node), on the node.
"""

from __future__ import annotations

import hmac
import http.client
import io
import json
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Headers of one connection, not of the request (RFC 9110 7.6.1), and those the proxy sets itself.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding"}
    | {"upgrade", "host", "server", "date"}
)
# Not passed on with a request either: its length is written from the one the proxy checked,
# and the proxy answers Expect: 100-continue itself, once the request has passed its checks.
NOT_FORWARDED = HOP_BY_HOP | {"content-length", "expect"}
# A generation on CPU may take long before its first byte; a dead engine must not hold a thread forever.
UPSTREAM_TIMEOUT_SECONDS = 3600.0
CHUNK = 64 * 1024
# Each connection is a thread: a flood of connections must cost neither threads nor memory
# beyond this. A server of one model rarely has more requests in flight; more wait client-side.
MAX_CONNECTIONS = 64
# A connection silent this long is closed: an idle keep-alive one, a stalled client, or one
# opened only to hold a thread (the openai client opens a new one when its pooled one is gone).
IDLE_TIMEOUT_SECONDS = 30.0
# A request must arrive whole (line, headers, body) this soon after its first byte: a client
# that sends a byte every few seconds never trips the idle timeout. Time for a MAX_BODY_BYTES
# body at about 0.6 MB/s (a tunnel from a laptop); a chat request is a few kB.
REQUEST_DEADLINE_SECONDS = 120.0
# The largest request body passed on: a long context is a few MB of JSON, images as base64 a
# few more. A Content-Length over it is refused before a byte of the body is read.
MAX_BODY_BYTES = 64 << 20
# How often at most the proxy says that it turns connections away (a flood must not flood the log).
BUSY_LOG_SECONDS = 60.0
# Token characters of a header's name (RFC 9110 5.6.2).
TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def bearer(key: str) -> dict[str, str]:
    """The header a request carries the key in."""
    return {"Authorization": f"Bearer {key}"}


def error_body(message: str, code: str) -> bytes:
    """An error as OpenAI's servers write it (the openai client reads its message)."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def _busy_answer() -> bytes:
    body = error_body("the server has as many connections open as it takes: retry in a moment", "server_busy")
    head = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    return f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


BUSY = _busy_answer()


class UnixConnection(http.client.HTTPConnection):
    """HTTP over the engine's Unix socket."""

    def __init__(self, path: str, timeout: float = UPSTREAM_TIMEOUT_SECONDS):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class KeyProxy(ThreadingHTTPServer):
    """Listens on ``address``; passes requests that carry ``key`` to the server on ``upstream``.
    The limits are attributes, the module's constants unless set before ``serve_forever``."""

    daemon_threads = True
    # Stopping does not wait for clients (a slow one may take REQUEST_DEADLINE_SECONDS): their
    # threads end with the supervisor.
    block_on_close = False
    max_connections = MAX_CONNECTIONS
    idle_timeout = IDLE_TIMEOUT_SECONDS
    request_deadline = REQUEST_DEADLINE_SECONDS
    max_body = MAX_BODY_BYTES

    def __init__(self, address: tuple[str, int], upstream: str, key: str):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.upstream = upstream
        self.expected = f"Bearer {key}".encode()
        self._lock = threading.Lock()
        self._open = 0
        self._busy_said = -BUSY_LOG_SECONDS
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own asks the resolver for the address's name (getfqdn): seconds on a
        # node whose reverse DNS does not answer, for a name nothing here uses.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def process_request(self, request, client_address) -> None:
        """A thread for the connection if fewer than ``max_connections`` are open, else 503."""
        with self._lock:
            admitted = self._open < self.max_connections
            if admitted:
                self._open += 1
        if not admitted:
            self._turn_away(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()  # no thread started: its slot is free
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._open -= 1

    def _turn_away(self, request: socket.socket, client_address: tuple) -> None:
        """503 and close, from the accepting thread: it never waits on the client (a new
        connection's send buffer takes the short answer whole, or it is dropped)."""
        try:
            request.setblocking(False)
            request.send(BUSY)
        except OSError:
            pass
        self.shutdown_request(request)
        now = time.monotonic()
        if now - self._busy_said >= BUSY_LOG_SECONDS:
            self._busy_said = now
            print(
                f"jobgen-serve: {self.max_connections} connections open, the most the key proxy takes:"
                f" turned away one from {client_address[0]} (and any more in the next {BUSY_LOG_SECONDS:g} s)",
                flush=True,
            )

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that went away or was too slow: nothing to report
        super().handle_error(request, client_address)


class _ClientGone(Exception):
    """The client stopped sending its body: closed the connection, or ran out of time."""

    def __init__(self, timed_out: bool):
        super().__init__("timed out" if timed_out else "closed")
        self.timed_out = timed_out


class _TimedReader(io.RawIOBase):
    """The client's side of a connection, read under the proxy's bounds: each read waits at
    most ``idle`` seconds, and once a request's first byte has come (``arm``, at each request),
    all its reads together at most ``deadline`` seconds, until ``disarm``."""

    def __init__(self, sock: socket.socket, idle: float, deadline: float):
        super().__init__()
        self.sock, self.idle, self.deadline = sock, idle, deadline
        self.armed = False
        self.until: float | None = None

    def readable(self) -> bool:
        return True

    def arm(self) -> None:
        self.armed, self.until = True, None

    def disarm(self) -> None:
        """The request is read: the answer's writes wait at most ``idle`` on a client that reads nothing."""
        self.armed, self.until = False, None
        self.sock.settimeout(self.idle)

    def readinto(self, buffer) -> int:
        wait = self.idle
        if self.until is not None:
            wait = min(wait, self.until - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"the request took over {self.deadline:g} s to arrive")
        self.sock.settimeout(wait)
        count = self.sock.recv_into(buffer)
        if count and self.armed and self.until is None:
            self.until = time.monotonic() + self.deadline
        return count


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: KeyProxy

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout
        super().setup()
        self.rfile.close()  # the plain reader, replaced by one under the bounds
        self.reader = _TimedReader(self.connection, self.server.idle_timeout, self.server.request_deadline)
        self.rfile = io.BufferedReader(self.reader, CHUNK)

    def handle_one_request(self) -> None:
        self.reader.arm()  # a timeout while reading it is caught by the base class: it closes the connection
        super().handle_one_request()

    def handle_expect_100(self) -> bool:
        return True  # not yet: 100 Continue only once the request has passed the checks (_forward)

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass  # the engine logs requests; the proxy says only what it refused (_refuse)

    def _authorized(self) -> bool:
        given = self.headers.get_all("Authorization") or []
        token = given[0].encode("latin-1", errors="replace") if len(given) == 1 else b""
        return hmac.compare_digest(token, self.server.expected)

    def _reply(self, status: int, message: str, code: str, extra: dict[str, str] | None = None) -> None:
        self.reader.disarm()
        body = error_body(message, code)
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(extra or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")  # an unread request body would be taken for the next request
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _refuse(self) -> None:
        where = f"{self.command} {self.path[:200]!r} from {self.client_address[0]}"
        print(f"jobgen-serve: refused {where}: no valid API key", flush=True)
        message = "Incorrect or missing API key: send it as 'Authorization: Bearer <key>' (the openai client's api_key)"
        self._reply(401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    def _body_length(self) -> int | None:
        """The body's length, read the one way the engine will read it; None once refused."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get_all("Transfer-Encoding") is not None:
            if lengths:
                self._reply(400, "a request has a Content-Length or a Transfer-Encoding, not both", "bad_request")
            else:
                self._reply(411, "send the request body with a Content-Length", "length_required")
            return None
        if len(lengths) > 1:
            self._reply(400, "a request has one Content-Length at most", "bad_request")
            return None
        value = lengths[0].strip(" \t") if lengths else "0"
        if not (value.isascii() and value.isdigit()):
            self._reply(400, "the Content-Length is no number", "bad_request")
            return None
        digits = value.lstrip("0") or "0"
        if len(digits) > len(str(self.server.max_body)) or int(digits) > self.server.max_body:
            self._reply(413, f"the request body is over {self.server.max_body} bytes", "request_too_large")
            return None
        return int(digits)

    def _passed_headers(self, length: int) -> list[tuple[str, str]] | None:
        """The headers passed on, as read; None once refused for a malformed one."""
        passed = [(n, v) for n, v in self.headers.items() if n.lower() not in NOT_FORWARDED]
        malformed = self.headers.defects or any(
            not n or not TOKEN.issuperset(n) or "\r" in v or "\n" in v or "\0" in v for n, v in passed
        )
        if malformed:
            self._reply(400, "a header line is malformed or folded", "bad_request")
            return None
        if self.headers.get_all("Content-Length") is not None:
            passed.append(("Content-Length", str(length)))
        return passed

    def _forward(self) -> None:
        if not self._authorized():
            self._refuse()
            return
        length = self._body_length()
        headers = None if length is None else self._passed_headers(length)
        if length is None or headers is None:
            return
        if length and self.request_version >= "HTTP/1.1" and self.headers.get("Expect", "").lower() == "100-continue":
            self.send_response_only(100)
            self.end_headers()
        upstream = UnixConnection(self.server.upstream)
        try:
            response = self._pass_on(upstream, headers, length)
        except _ClientGone as gone:
            upstream.close()
            self.close_connection = True
            if gone.timed_out:
                self._reply(408, "the request did not arrive in the time allowed", "request_timeout")
            return
        except ValueError:  # a path or header http.client will not send: nothing was sent
            upstream.close()
            self._reply(400, "the request line or a header is malformed", "bad_request")
            return
        except (OSError, http.client.HTTPException) as exc:
            upstream.close()
            self._reply(502, f"the model server does not answer: {exc}", "bad_gateway")
            return
        try:
            self._relay(response)
        except (OSError, http.client.HTTPException):
            self.close_connection = True  # the engine went away mid-answer: the client sees the cut
        finally:
            upstream.close()

    def _pass_on(self, upstream: UnixConnection, headers: list[tuple[str, str]], length: int):
        """The request to the engine, its body in pieces as they come; the engine's answer."""
        encoding_given = any(name.lower() == "accept-encoding" for name, _ in headers)
        upstream.putrequest(self.command, self.path, skip_accept_encoding=encoding_given)
        for name, value in headers:
            upstream.putheader(name, value)
        upstream.endheaders()  # the first byte the engine sees
        left = length
        while left > 0:
            try:
                piece = self.rfile.read1(min(left, CHUNK))
            except OSError as exc:
                raise _ClientGone(timed_out=isinstance(exc, TimeoutError)) from exc
            if not piece:
                raise _ClientGone(timed_out=False)
            upstream.send(piece)
            left -= len(piece)
        self.reader.disarm()
        return upstream.getresponse()

    def _relay(self, response: http.client.HTTPResponse) -> None:
        """The engine's answer, as it comes: with its length when it said one, else in chunks."""
        self.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        bodyless = self.command == "HEAD" or response.status in (204, 304) or response.status < 200
        chunked = not bodyless and response.getheader("Content-Length") is None
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if bodyless:
            return
        while piece := response.read1(CHUNK):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
