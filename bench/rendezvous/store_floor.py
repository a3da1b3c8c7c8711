"""The floor under a rendezvous round: one store call of each kind on an idle store, a TCPStore
beside etcd, and etcd's own layers under `EtcdStore` (an HTTP round trip that reaches no KV
code, a serializable and a linearizable range, a put). Not a bench of its own: rendezvous_scale
runs it (`--floor-calls`, `--floor-blocks`; its `--smoke` too).

Each call is timed `calls` times per block, the backends alternating block by block; beside the
wall time, the CPU time it cost the calling thread and the store (the TCPStore's threads, or
the three etcd members), and on etcd the requests etcd counted.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from bench.common.report import pair_ratios, ratio_cell, table
from bench.common.timing import p99, per_call_us
from bench.rendezvous.stores import (
    HOST,
    STORE_TIMEOUT,
    EtcdServer,
    Server,
    StoreServer,
    member_addresses,
    requests_between,
)


@dataclasses.dataclass
class Floor:
    """One kind of call, timed `calls` times per block: wall time (us), and the CPU time it
    cost the calling thread and the store (the TCPStore's threads; etcd: its members)."""

    call: str
    backend: str
    times_us: list[float] = dataclasses.field(default_factory=list)
    block_medians: dict[int, float | None] = dataclasses.field(default_factory=dict)
    client_cpu_s: float = 0.0
    store_cpu_s: float = 0.0
    requests: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


FloorCall = tuple[str, Callable[[], Any]]


def store_calls(store: dist.Store) -> list[FloorCall]:
    """The calls a barrier round is made of, each on a key that exists (no wait)."""
    store.set("floor/k", "v")
    store.set("floor/n", "0")
    return [
        ("get (an existing key)", lambda: store.get("floor/k")),
        ("check (an existing key)", lambda: store.check(["floor/k"])),
        ("compare_set (succeeds, same value)", lambda: store.compare_set("floor/k", "v", "v")),
        ("add 1", lambda: store.add("floor/n", 1)),
        ("add 0 (a read, by its meaning)", lambda: store.add("floor/n", 0)),
        ("set", lambda: store.set("floor/k", "v")),
    ]


def etcd_layers(cluster: Any) -> list[FloorCall]:
    """The layers under `EtcdStore.get`, on the member an EtcdStore asks first (the first
    listed), through etcd3gw's client as EtcdStore's: an HTTP round trip that reaches no KV code,
    a range the member answers from its own copy, a linearizable range (a Raft read index first:
    what every EtcdStore read is), a put (a Raft write: the WAL fsync of a quorum)."""
    import base64

    from etcd3gw.client import Etcd3Client

    host, port = member_addresses(cluster)[0]
    client = Etcd3Client(host, port, api_path="/v3/")
    key = base64.b64encode(b"/ftrun/bench-floor/floor/k").decode()
    value = base64.b64encode(b"v").decode()
    version = client.base_url + "/version"
    kv_range, kv_put = client.get_url("/kv/range"), client.get_url("/kv/put")
    return [
        ("etcd layer: HTTP GET /version (no KV)", lambda: client.session.get(version).json()),
        (
            "etcd layer: range, serializable (no Raft)",
            lambda: client.post(kv_range, json={"key": key, "serializable": True}),
        ),
        ("etcd layer: range, linearizable", lambda: client.post(kv_range, json={"key": key})),
        ("etcd layer: put", lambda: client.post(kv_put, json={"key": key, "value": value})),
    ]


@dataclasses.dataclass(frozen=True)
class Plan:
    """`calls` timed calls (after a tenth as many unmeasured) per block, `blocks` blocks."""

    calls: int
    blocks: int


def measure_floors(backends: Sequence[str], cluster: Any, plan: Plan) -> list[Floor]:
    """Every call of `store_calls` on each backend (and etcd's layers, on `cluster`), the
    backends alternating block by block."""
    servers: dict[str, Server] = {}
    calls: dict[str, list[FloorCall]] = {}
    if "tcp" in backends:
        tcp = StoreServer()
        servers["tcp"] = tcp
        client = dist.TCPStore(HOST, tcp.port, is_master=False, timeout=STORE_TIMEOUT)
        calls["tcp"] = store_calls(client)
    if "etcd" in backends:
        from ftrun.store.etcd_store import EtcdStore

        servers["etcd"] = EtcdServer(cluster)
        etcd = EtcdStore(member_addresses(cluster), "bench-floor", STORE_TIMEOUT)
        calls["etcd"] = store_calls(etcd) + etcd_layers(cluster)
    floors = {(b, name): Floor(name, b) for b, cs in calls.items() for name, _ in cs}
    try:
        for block in range(plan.blocks):
            order = list(calls) if block % 2 == 0 else list(calls)[::-1]
            for backend in order:
                for name, call in calls[backend]:
                    _floor_block(floors[backend, name], servers[backend], call, block, plan.calls)
    finally:
        for server in servers.values():
            server.close()
    return list(floors.values())


def _floor_block(
    floor: Floor, server: Server, call: Callable[[], Any], block: int, count: int
) -> None:
    for _ in range(count // 10):  # warm: connections, caches
        call()
    requests0, store0, client0 = server.requests(), server.cpu_s(), time.thread_time()
    times = per_call_us(call, count)
    floor.client_cpu_s += time.thread_time() - client0
    floor.store_cpu_s += server.cpu_s() - store0
    requests1 = server.requests()
    if requests0 is not None and requests1 is not None:
        floor.requests.update(requests_between(requests0, requests1))
    floor.times_us += times
    floor.block_medians[block] = statistics.median(times)


def floor_rows(floors: Sequence[Floor]) -> list[list[str]]:
    by_key = {(f.backend, f.call): f for f in floors}
    names = list(dict.fromkeys(f.call for f in floors))
    rows = []
    for name in names:
        tcp, etcd = by_key.get(("tcp", name)), by_key.get(("etcd", name))
        ratio = (
            ratio_cell(pair_ratios(etcd.block_medians, tcp.block_medians)) if tcp and etcd else "-"
        )
        rows.append(
            [
                name,
                _floor_time(tcp),
                _floor_time(etcd),
                ratio,
                _per_call_us(tcp, "client"),
                _per_call_us(etcd, "client"),
                _per_call_us(tcp, "store"),
                _per_call_us(etcd, "store"),
                _requests_per_call(etcd),
            ]
        )
    return rows


def _floor_time(floor: Floor | None) -> str:
    if floor is None:
        return "-"
    return f"{statistics.median(floor.times_us):.0f} (p99 {p99(floor.times_us):.0f})"


def _per_call_us(floor: Floor | None, whose: str) -> str:
    if floor is None or not floor.times_us:
        return "-"
    cpu = floor.client_cpu_s if whose == "client" else floor.store_cpu_s
    if whose == "store" and cpu == 0:  # counted in clock ticks: less than one in all
        return f"< {1e6 / os.sysconf('SC_CLK_TCK') / len(floor.times_us):.0f}"
    return f"{cpu / len(floor.times_us) * 1e6:.0f}"


def _requests_per_call(floor: Floor | None) -> str:
    if floor is None or not floor.requests:
        return "-"
    calls = len(floor.times_us)
    return ", ".join(f"{m} {n / calls:.2f}" for m, n in sorted(floor.requests.items()))


def floor_report(floors: Sequence[Floor], plan: Plan) -> str:
    header = [
        "call",
        "TCPStore us, median (p99)",
        "etcd us, median (p99)",
        "etcd/tcp, block by block",
        "client CPU us/call, tcp",
        "etcd",
        "store CPU us/call, tcp",
        "etcd (3 members)",
        "etcd requests/call",
    ]
    text = table(header, floor_rows(floors), markdown=True)
    return (
        f"{text}\n\n{plan.blocks} blocks x {plan.calls} calls per row and backend "
        "(after a tenth as many unmeasured), one client in this process, the backends "
        "alternating block by block; TCPStore: served by this process (libuv); etcd: the "
        "bench's 3 members, through the member an EtcdStore asks first (the first listed). "
        "Store CPU: the TCPStore's threads, or the three etcd processes.\n"
    )
