"""``transformers serve`` on a Unix socket, for jobgen's key proxy (jobgen.serve.proxy).

    python -m jobgen.serve.uds /tmp/jobgen-sock-x/engine.sock serve tiny-sft --port 8000 ...

``transformers serve`` listens on TCP only, and has no API key. With ``[serve] api_key_env``
jobgen runs it through this module instead: the arguments after the socket are the
``transformers`` command line as it would be, and the uvicorn server it builds binds the
socket rather than its host and port. The socket's directory is the supervisor's, mode
0700 (tempfile.mkdtemp): no other user on the node can reach the server around the key.

It runs as the engine's own process, in the job's Python; jobgen's CLI never imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def on_socket(path: str) -> None:
    """Make every uvicorn server of this process bind ``path`` instead of a host and port.
    transformers' `serve` builds its uvicorn.Config with host= and port= (5.x); anything
    else fails loudly here rather than listening on TCP without the key."""
    import uvicorn

    tcp_config = uvicorn.Config

    class SocketConfig(tcp_config):  # type: ignore[misc,valid-type]
        def __init__(self, app: Any, *args: Any, **kwargs: Any):
            if args:  # host and port may be among them: refuse rather than listen on TCP
                raise SystemExit("jobgen.serve.uds: uvicorn.Config got positional arguments, cannot move it")
            kwargs.pop("host", None)
            kwargs.pop("port", None)
            super().__init__(app, uds=path, **kwargs)

    uvicorn.Config = SocketConfig  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> int:
    path, *command = list(sys.argv[1:] if argv is None else argv)
    on_socket(path)
    from transformers.cli.transformers import main as transformers_main

    sys.argv = ["transformers", *command]
    return transformers_main() or 0


if __name__ == "__main__":
    sys.exit(main())
