"""Who this node is: the address other nodes reach it at, and the one name it goes by.

The same name prefixes the launcher's log lines, names its events file and appears in every
event and report. Torch-free: the CLI needs it before the agent (and torch) is imported.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import socket
from collections.abc import Mapping
from pathlib import Path


def is_local_host(host: str) -> bool:
    """True when `host` names this machine (a loopback address or one of its own)."""
    with contextlib.suppress(ValueError):  # not an address: a name
        if ipaddress.ip_address(host).is_loopback:
            return True
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


def this_node(
    endpoint: str, local_addr: str | None, given_name: str | None, environ: Mapping[str, str]
) -> tuple[str, str]:
    """(advertised host, node name) of this launcher, from the rendezvous endpoint and
    --local-addr; the name is `given_name` (--ft-node-name), else Slurm's node name, else host
    and pid (several agents per host)."""
    host = advertised_host(endpoint, local_addr)
    return host, given_name or environ.get("SLURMD_NODENAME") or f"{host}-{os.getpid()}"


MASTER_PORT_SPAN = 3
"""Ports kept free from MASTER_PORT on: scripts serve more stores next to it (NVRx's in-process
examples at MASTER_PORT + 1, ftrun's tests also at + 2)."""


def free_port(host: str = "127.0.0.1", span: int = MASTER_PORT_SPAN) -> int:
    """A TCP port free on this host now, with the `span - 1` ports after it, for a server that
    listens later (the workers' MASTER_PORT); OSError if none is found in 1,000 tries.

    It comes from outside the kernel's ephemeral range (below it where there is room): a port
    that `bind(0)` hands out sits among those the kernel gives next to this agent's own
    listeners and to the local end of outgoing connections (an agent's peer channel once took
    MASTER_PORT + 2 so). Outside the range only another explicit pick can collide."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    first, end = _outside_ephemeral()
    for _ in range(1000):
        port = random.randrange(first, end - span + 1)
        if all(_bindable(family, candidate) for candidate in range(port, port + span)):
            return port
    raise OSError(f"no {span} free TCP ports in a row found in {first}-{end - 1}")


def _bindable(family: socket.AddressFamily, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def _outside_ephemeral() -> tuple[int, int]:
    """[first, end) of the ports to pick from: up to 16,384 below the ephemeral range, else
    above it, else (a range that leaves no room) any unprivileged port."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low - 1024 >= 1024:
        return max(1024, low - 16384), low
    if 65535 - high >= 1024:
        return high + 1, 65536
    return 1024, 65536
