"""The API key in front of a server that has none: jobgen's own small HTTP proxy.

    proxy = KeyProxy(("10.1.2.3", 8000), "/tmp/jobgen-sock-x/engine.sock", key)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()

``transformers serve`` has no API key, and vLLM's covers only some paths (/v1, /v2,
/inference, ...; /invocations, /tokenize, /pause stay open). With ``[serve] api_key_env``
the engine listens on a Unix socket in a directory only the job's user can open (vLLM's
--uds; transformers through jobgen.serve.uds), and this proxy listens where the server would
have (serve.host, serve.port): each request, on every path, must carry ``Authorization:
Bearer <key>`` (what the ``openai`` client sends), else it gets OpenAI's 401 before its body
is read; an authorized one is passed to the socket as it is (its Authorization too: vLLM
checks the key again), and the answer streamed back piece by piece (server-sent events
included). The key is compared in constant time and never logged.

Standard library only: it runs in the supervisor (jobgen.serve.node), on the node.
"""

from __future__ import annotations

import hmac
import http.client
import json
import socket
import socketserver
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Headers of one connection, not of the request (RFC 9110 7.6.1), and those the proxy sets itself.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding"}
    | {"upgrade", "host", "server", "date"}
)
# A generation on CPU may take long before its first byte; a dead engine must not hold a thread forever.
UPSTREAM_TIMEOUT_SECONDS = 3600.0
CHUNK = 64 * 1024


def bearer(key: str) -> dict[str, str]:
    """The header a request carries the key in."""
    return {"Authorization": f"Bearer {key}"}


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
    """Listens on ``address``; passes requests that carry ``key`` to the server on ``upstream``."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], upstream: str, key: str):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.upstream = upstream
        self.expected = f"Bearer {key}".encode()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own asks the resolver for the address's name (getfqdn): seconds on a
        # node whose reverse DNS does not answer, for a name nothing here uses.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: KeyProxy

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass  # the engine logs requests; the proxy says only what it refused (_refuse)

    def _authorized(self) -> bool:
        given = (self.headers.get("Authorization") or "").encode("latin-1", errors="replace")
        return hmac.compare_digest(given, self.server.expected)

    def _reply(self, status: int, message: str, code: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(extra or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")  # an unread request body would be taken for the next request
        self.end_headers()
        self.wfile.write(body.encode())
        self.close_connection = True

    def _refuse(self) -> None:
        where = f"{self.command} {self.path[:200]!r} from {self.client_address[0]}"
        print(f"jobgen-serve: refused {where}: no valid API key", flush=True)
        message = "Incorrect or missing API key: send it as 'Authorization: Bearer <key>' (the openai client's api_key)"
        self._reply(401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    def _forward(self) -> None:
        if not self._authorized():
            self._refuse()
            return
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self._reply(411, "send the request body with a Content-Length", "length_required")
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._reply(400, "the Content-Length is no number", "bad_request")
            return
        body = self.rfile.read(length) if length > 0 else None
        headers = {name: value for name, value in self.headers.items() if name.lower() not in HOP_BY_HOP}
        upstream = UnixConnection(self.server.upstream)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
        except OSError as exc:
            upstream.close()
            self._reply(502, f"the model server does not answer: {exc}", "bad_gateway")
            return
        try:
            self._relay(response)
        except (OSError, http.client.HTTPException):
            self.close_connection = True  # the engine went away mid-answer: the client sees the cut
        finally:
            upstream.close()

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
