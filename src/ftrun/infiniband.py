"""InfiniBand NIC health, read from sysfs (no torch, no tools): the agent's check before every
rendezvous round and its health watch (`check_ib_ports`), and a worker's check of the NIC
nearest its GPU (`nearest_ib_device`, `ib_ports_down`, for `inprocess.health_check`).

The agent's check reads every port of every device under the root (the kernel's
`/sys/class/infiniband`, or a fake tree in tests):

    <root>/<device>/ports/<port>/state                 "4: ACTIVE"
    <root>/<device>/ports/<port>/phys_state            "5: LinkUp"
    <root>/<device>/ports/<port>/counters/link_downed  "0"

A port is healthy when it is ACTIVE, physically LinkUp, and its link_downed counter has not grown
since this process's previous check (the first check records the baseline). A grown counter
means the link went down and came back between two rounds: a flapping cable or transceiver that
will stall the collectives again, so the node stays unhealthy (the baseline is not moved past
the increase). A file that cannot be read is a failure too, named by its path. No root or no
devices: a node without InfiniBand, nothing to check (logged once).

NVRx reads port 1 of each device through `{nic}` path templates and only fails a port that was
ACTIVE at its first look; here every port must be up at every check, and one root covers the
three files, so a test points the whole check at a fake tree with one option.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from ftrun.errors import NodeUnhealthyError

log = logging.getLogger("ftrun.agent")  # only the agent's check logs: its lines keep its name

IB_ROOT = "/sys/class/infiniband"
PCI_ROOT = "/sys/bus/pci/devices"
ACTIVE = "ACTIVE"
LINK_UP = "LinkUp"

_link_downed: dict[str, int] = {}
"""link_downed per counter file at this process's previous check (one agent per process)."""
_empty_logged: set[str] = set()


class _Unreadable(Exception):
    """A sysfs file or directory that could not be read or parsed (the message names it)."""


def check_ib_ports(root: str, baseline: MutableMapping[str, int] | None = None) -> dict[str, int]:
    """`{"ib_ports": N}` for the `health_check` event, or NodeUnhealthyError naming every bad
    port in one line. `baseline`: link_downed by counter path from the previous check, updated
    in place (default: this process's own)."""
    seen = _link_downed if baseline is None else baseline
    problems: list[str] = []
    ports = 0
    try:
        devices = _names(root, missing_ok=True)
    except _Unreadable as exc:
        raise NodeUnhealthyError(f"InfiniBand: {exc}") from None
    for device in devices:
        ports_dir = os.path.join(root, device, "ports")
        try:
            numbers = _names(ports_dir)
        except _Unreadable as exc:
            problems.append(f"{device}: {exc}")
            continue
        for number in numbers:
            ports += 1
            port = f"{device} port {number}"
            problem = _port_problem(port, os.path.join(ports_dir, number), seen)
            if problem:
                problems.append(problem)
    if problems:
        raise NodeUnhealthyError("InfiniBand " + "; ".join(problems))
    if not devices and root not in _empty_logged:
        log.info("NIC health check: no InfiniBand devices under %s; nothing to check", root)
        _empty_logged.add(root)
    return {"ib_ports": ports}


def _port_problem(port: str, path: str, seen: MutableMapping[str, int]) -> str | None:
    """What is wrong with one port ("mlx5_0 port 1: state DOWN (not ACTIVE)"), or None."""
    counter = os.path.join(path, "counters", "link_downed")
    try:
        state = _value(os.path.join(path, "state"))
        physical = _value(os.path.join(path, "phys_state"))
        downed = _counter(counter)
    except _Unreadable as exc:
        return f"{port}: {exc}"
    wrong = []
    if state != ACTIVE:
        wrong.append(f"state {state or '(empty)'} (not {ACTIVE})")
    if physical != LINK_UP:
        wrong.append(f"physical state {physical or '(empty)'} (not {LINK_UP})")
    before = seen.get(counter)
    if before is not None and downed > before:
        # Keep the old baseline: a link that flapped stays suspect at every later check.
        wrong.append(f"link_downed {before} -> {downed} since the last check (the link flapped)")
    else:
        seen[counter] = downed  # first look, no change, or a reset counter (driver reload)
    return f"{port}: {', '.join(wrong)}" if wrong else None


def nearest_ib_device(
    gpu_bus_id: str, ib_root: str = IB_ROOT, pci_root: str = PCI_ROOT
) -> str | None:
    """The InfiniBand device sharing the longest PCI path with the GPU; None without devices,
    when the GPU is not in sysfs, or on a tie (then no NIC belongs to this GPU more than
    another)."""
    try:
        devices = sorted(os.listdir(ib_root))
    except OSError:
        return None
    gpu = os.path.realpath(os.path.join(pci_root, gpu_bus_id))
    if not os.path.exists(gpu):
        return None
    depth = {}
    for device in devices:
        nic = os.path.realpath(os.path.join(ib_root, device, "device"))
        depth[device] = len(os.path.commonpath([gpu, nic]).split(os.sep))
    best = max(depth.values(), default=0)
    nearest = [device for device, d in depth.items() if d == best]
    return nearest[0] if len(nearest) == 1 else None


def ib_ports_down(device_dir: str) -> list[str]:
    """The ports of one InfiniBand device whose `state` is not ACTIVE ("1 (DOWN)"); none when
    its ports cannot be listed."""
    ports_dir = os.path.join(device_dir, "ports")
    try:
        ports = _names(ports_dir)
    except _Unreadable:
        return []
    down = []
    for port in ports:
        try:
            state = _value(os.path.join(ports_dir, port, "state"))
        except _Unreadable:
            state = "unreadable"
        if state != ACTIVE:
            down.append(f"{port} ({state or 'empty'})")
    return down


def _names(directory: str, missing_ok: bool = False) -> list[str]:
    """The entries of `directory`, in numeric-then-name order ("2" before "10")."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        if missing_ok:
            return []
        raise _Unreadable(f"cannot list {directory}: no such directory") from None
    except OSError as exc:
        raise _Unreadable(f"cannot list {directory}: {exc.strerror or exc}") from None
    return sorted(names, key=lambda name: (len(name), name))


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError as exc:
        raise _Unreadable(f"cannot read {path}: {exc.strerror or exc}") from None


def _value(path: str) -> str:
    """A state file's name: "4: ACTIVE" -> "ACTIVE" (a bare "ACTIVE" is taken as it is)."""
    return _read(path).rpartition(":")[2].strip()


def _counter(path: str) -> int:
    text = _read(path)
    try:
        return int(text)
    except ValueError:
        raise _Unreadable(f"cannot parse {path}: {text!r} is not a number") from None
