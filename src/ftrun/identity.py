"""Who this node is: the address other nodes reach it at, and the one name it goes by.

The same name prefixes the launcher's log lines, names its events file and appears in every
event and report. Torch-free: the CLI needs it before the agent (and torch) is imported.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Mapping


def is_local_host(host: str) -> bool:
    """True when `host` names this machine (a loopback address or one of its own)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        local = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return any(ipaddress.ip_address(a).is_loopback for a in addresses) or bool(addresses & local)


def advertised_host(endpoint: str, local_addr: str | None) -> str:
    """The address other nodes use for this one: --local-addr, loopback in local runs, FQDN."""
    if local_addr:
        return local_addr
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    with contextlib.suppress(OSError, ValueError):
        resolved = socket.getaddrinfo(host, None)[0][4][0]
        if ipaddress.ip_address(resolved).is_loopback:
            return "127.0.0.1"
    if is_local_host(host):
        return host
    return socket.getfqdn()


def node_name(given: str | None, environ: Mapping[str, str], host: str) -> str:
    """`given` (--ft-node-name), else Slurm's node name, else host and pid (several agents
    per host)."""
    return given or environ.get("SLURMD_NODENAME") or f"{host}-{os.getpid()}"


def this_node(
    endpoint: str, local_addr: str | None, given_name: str | None, environ: Mapping[str, str]
) -> tuple[str, str]:
    """(advertised host, node name) of this launcher, from the rendezvous endpoint,
    --local-addr and --ft-node-name."""
    host = advertised_host(endpoint, local_addr)
    return host, node_name(given_name, environ, host)


def free_port(host: str) -> int:
    """A TCP port free on this host now (for the workers' MASTER_PORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        return sock.getsockname()[1]
