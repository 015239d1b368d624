"""Where the serve job's server listens, and the key it asks for: decided on the node.

    listen_address("node7", "eth0", expose=False)   # -> '10.1.2.7', or ServeNodeError
    api_key("SERVE_API_KEY")                          # -> the value sbatch passed, or ServeNodeError

serve.host was checked when the spec was read, but only as far as it is an address literal
(jobgen.spec.tables.serve): a host name means what this node's resolver says, so it is resolved
here, every address it has is checked, and the server is told the address that passed,
never the name (what is checked is what is bound). The node's own address on the site's
interface is checked the same way: a cluster whose nodes have public addresses needs
serve.expose. The key comes from the job's environment, by name.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence

from jobgen.spec.tables.serve import MIN_API_KEY_LENGTH, exposure, exposure_refusal, numeric_address


class ServeNodeError(RuntimeError):
    """The server cannot be started here (no address on the interface, no engine, a refused address or key)."""


def interface_address(interface: str) -> str | None:
    """This node's first IPv4 address on ``interface``; None when it has none."""
    import psutil

    for addr in psutil.net_if_addrs().get(interface, []):
        if addr.family == socket.AF_INET:
            return addr.address
    return None


def host_addresses(host: str) -> list[str]:
    """The addresses a server told to listen on ``host`` binds: a literal as the OS reads it
    (serve_spec.numeric_address), a name as this node resolves it (every address: asyncio's
    servers bind them all)."""
    literal = numeric_address(host)
    if literal is not None:
        return [str(literal)]
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ServeNodeError(f"serve.host '{host}' does not resolve on node {socket.gethostname()}: {reason}") from None
    return list(dict.fromkeys(str(entry[4][0]) for entry in found))


def check_exposure(host: str | None, addresses: Sequence[str], expose: bool, interface: str | None = None) -> None:
    """Refuse a wildcard or public address without serve.expose: checked here too, where a
    name resolves as the server will see it. ``host`` None: the node's own address."""
    for address in addresses:
        parsed = ipaddress.ip_address(address.split("%")[0])
        what = exposure(parsed)
        if not what or expose:
            continue
        node = socket.gethostname()
        if host is None:
            where = f"on interface '{interface}'" if interface else "its hostname resolves to"
            raise ServeNodeError(
                f"refusing to listen on {address}, the address node {node} has {where}: it is {what}, and the "
                "model server would answer anyone who can reach it. Set serve.host to an address of the cluster's "
                "network, or serve.expose = true with serve.api_key_env to share it knowingly"
            )
        resolved = "" if numeric_address(host) is not None else f" (as node {node} resolves it)"
        raise ServeNodeError(f"refusing to listen there: {exposure_refusal(host, parsed, what)}{resolved}")


def listen_address(host: str | None, interface: str | None, *, expose: bool = False) -> str:
    """serve.host, resolved here, else the node's address on the site's interface, else the
    address its hostname resolves to: the one address the server listens on, never a wildcard
    or a public one without serve.expose."""
    if host:
        addresses = host_addresses(host)
    elif interface:
        address = interface_address(interface)
        if address is None:
            raise ServeNodeError(
                f"node {socket.gethostname()} has no IPv4 address on interface '{interface}' (site network.ifname)"
            )
        addresses = [address]
    else:
        addresses = [socket.gethostbyname(socket.gethostname())]
    check_exposure(host or None, addresses, expose, interface)
    return addresses[0]


def api_key(name: str | None) -> str | None:
    """The value of serve.api_key_env in this job's environment (sbatch passed it from the
    submitting shell); a key asked for and not usable stops the job before anything listens."""
    if name is None:
        return None
    key = os.environ.get(name, "")
    problem = key_problem(key)
    if problem:
        raise ServeNodeError(
            f"serve.api_key_env: ${name} {problem} in this job's environment (sbatch passes the submitting "
            "shell's; a site's --export in slurm.extra_sbatch may keep it out)"
        )
    return key


def key_problem(key: str) -> str | None:
    """Why ``key`` cannot be an API key, or None: unset, too short, or not one HTTP header token."""
    if not key:
        return "is not set"
    if len(key) < MIN_API_KEY_LENGTH:
        return f"is shorter than {MIN_API_KEY_LENGTH} characters"
    if not (key.isascii() and key.isprintable()) or " " in key:
        return "holds a space or a character that is not printable ASCII"
    return None


def free_port(host: str) -> int:
    """A port nothing listens on now. The server binds it a moment later; another process could
    take it in between, which a restart of the job answers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
