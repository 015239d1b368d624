"""``jobgen chat RUN``: a conversation with the served model, from a terminal or a pipe.

    jobgen chat RUN                         # type a message, Enter; /reset starts over, /exit or Ctrl-D ends
    printf 'Hello\\nAnd then?\\n' | jobgen chat RUN

Each line read is the user's next message; the whole conversation so far goes with it to
the server's ``/v1/chat/completions`` (which applies the model's chat template), and the
reply is printed as it streams in, then kept for the next turn. Server-sent events are read
with the standard library: the CLI stays fast and needs no client package. Any OpenAI
client works as well: base URL and model name are in ``serve.json`` (``jobgen serve RUN --status``).
A server started with ``[serve] api_key_env`` gets the key from the variable of that name in
the user's environment (serve.json holds the name, never the value).

A request the server refuses (a 4xx: too long, a bad parameter) is reported and left out of
the conversation; the chat goes on. A server that cannot be reached ends it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

RESET, EXITS = "/reset", ("/exit", "/quit")


class ChatError(RuntimeError):
    """The server could not be reached, or answered with something that is no chat completion."""


class Refused(RuntimeError):
    """The server answered the request with an HTTP error; ``status`` and its message."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"the server refused the request (HTTP {status}): {message}")


@dataclass
class Conversation:
    """The messages so far, and how to ask for the next reply."""

    url: str  # the server's base URL, ending in /v1
    model: str
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    api_key: str | None = None  # sent as 'Authorization: Bearer ...' when the server asks for one
    timeout: float = 600.0
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def request(self, messages: list[dict[str, str]]) -> urllib.request.Request:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(
            f"{self.url.rstrip('/')}/chat/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
        )

    def ask(self, text: str) -> Iterator[str]:
        """The reply to ``text``, piece by piece as the server streams it; once it is complete,
        both messages join the conversation (a refused or cut request leaves it as it was)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        pieces = []
        for piece in _stream(self.request(messages), self.timeout):
            pieces.append(piece)
            yield piece
        self.messages = [*messages, {"role": "assistant", "content": "".join(pieces)}]


def _error_message(body: bytes) -> str:
    """The error text of a refusal: FastAPI's {"detail": ...}, OpenAI's and vLLM's {"error": {"message"}}."""
    try:
        value = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:500]
    if isinstance(value, dict):
        error = value.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("detail", "message", "error"):
            if value.get(key):
                return str(value[key])
    return json.dumps(value)[:500]


def _stream(request: urllib.request.Request, timeout: float) -> Iterator[str]:
    """The content deltas of a streamed chat completion. The stream ends at 'data: [DONE]'
    (OpenAI, vLLM) or when the server closes it (transformers serve sends no [DONE])."""
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise Refused(exc.code, _error_message(exc.read())) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ChatError(f"cannot reach the server at {request.full_url}: {reason}") from None
    with response:
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except ValueError:
                raise ChatError(f"the server sent something that is no JSON event: {data[:200]!r}") from None
            if isinstance(chunk, dict) and chunk.get("error"):
                raise Refused(500, _error_message(data.encode()))
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    yield content


def chat(conversation: Conversation, lines: Iterable[str], out: TextIO, err: TextIO, *, prompt: bool) -> int:
    """Read messages from ``lines`` until they end or /exit, print each reply as it streams.
    ``prompt``: show '> ' before each message (a terminal). Exit status 0, or 1 when the
    server could not be reached."""
    if prompt:
        out.write(f"chatting with '{conversation.model}' at {conversation.url}; {RESET} starts over, /exit ends\n")
    source = iter(lines)
    while True:
        if prompt:
            out.write("> ")
            out.flush()
        line = next(source, None)
        if line is None:
            break
        text = line.rstrip("\n")
        if text.strip() in EXITS:
            break
        if text.strip() == RESET:
            conversation.reset()
            out.write("(conversation reset)\n")
            continue
        if not text.strip():
            continue
        try:
            for piece in conversation.ask(text):
                out.write(piece)
                out.flush()
        except Refused as exc:
            out.write("\n")
            err.write(f"jobgen chat: {exc}\n")
            continue
        except ChatError as exc:
            out.write("\n")
            err.write(f"jobgen chat: {exc}\n")
            return 1
        out.write("\n")
        out.flush()
    return 0
