"""The rendezvous benches' stores: a TCPStore served by the bench process, and a real 3-member
etcd cluster on 127.0.0.1 (the tests' own, tests/etcd_cluster.py, Debian's /usr/bin/etcd); for
both, what they cost (the CPU time of the TCPStore's threads, or of the etcd members), and for
etcd what it served (its /metrics).

etcd's requests are counted by etcd itself: `grpc_server_handled_total` of the KV service,
summed over the members. Every JSON-gateway request (`/v3/kv/range`, `/v3/kv/txn`, ...) is one
gRPC call there, so the counts are exact, per method, and need nothing in the client.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import re
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist

from bench.common import harness

HOST = "127.0.0.1"
STORE_TIMEOUT = datetime.timedelta(seconds=120)
KV_METHODS = ("Range", "Txn", "Put", "DeleteRange", "Watch")
_HANDLED = re.compile(
    r'^grpc_server_handled_total\{grpc_code="(?P<code>[^"]*)",grpc_method="(?P<method>[^"]*)",'
    r'grpc_service="etcdserverpb\.KV"[^}]*\} (?P<value>\S+)$',
    re.MULTILINE,
)
_WATCHES = re.compile(
    r'^grpc_server_started_total\{grpc_method="(?P<method>Watch)",'
    r'grpc_service="etcdserverpb\.Watch"[^}]*\} (?P<value>\S+)$',
    re.MULTILINE,
)
"""Watch streams opened (an EtcdStore's blocking read: one HTTP request each); a stream is
"handled" only when it ends, so the count is of the ones started."""
METRICS_TIMEOUT_S = 10.0
LEADER_WAIT_S = 10.0


class EtcdMissing(RuntimeError):
    """No etcd binary here (tests/etcd/install-etcd.sh installs Debian's etcd-server)."""


@contextlib.contextmanager
def etcd_cluster(members: int = 3) -> Iterator[Any]:
    """A started `tests/etcd_cluster.EtcdCluster` (etcd's defaults, but for the tests' 50 ms
    heartbeat and 500 ms election timeout) in a scratch directory; on exit its members are
    killed (their process groups) and the directory removed."""
    import pytest  # the tests' module says "skip" when etcd is missing; a bench says why

    etcd_cluster_module = harness.etcd_cluster()

    tmp = Path(tempfile.mkdtemp(prefix="ftrun-bench-etcd-"))
    try:
        try:
            cluster = etcd_cluster_module.EtcdCluster(tmp, members)
        except pytest.skip.Exception as exc:
            raise EtcdMissing(str(exc)) from None
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def member_addresses(cluster: Any) -> list[tuple[str, int]]:
    """(host, port) of every member, in the cluster's order (what `--rdzv-endpoint` lists)."""
    return [("127.0.0.1", m.client_port) for m in cluster.members]


def kv_requests(cluster: Any) -> collections.Counter[str]:
    """KV requests the members have handled so far and watch streams opened, by method, summed
    over the members."""
    total: collections.Counter[str] = collections.Counter()
    for text in _metrics_texts(cluster):
        for match in (*_HANDLED.finditer(text), *_WATCHES.finditer(text)):
            total[match["method"]] += int(float(match["value"]))
    return total


def requests_between(
    before: collections.Counter[str], after: collections.Counter[str]
) -> dict[str, int]:
    return {m: after[m] - before[m] for m in KV_METHODS if after[m] - before[m]}


def members_cpu_s(cluster: Any) -> float:
    """User + system CPU time of the members' processes so far."""
    total = 0.0
    for member in cluster.members:
        if member.proc is None:
            continue
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(member.proc.pid).cpu_times()
            total += times.user + times.system
    return total


def leader(cluster: Any) -> int | None:
    """The index of the member that leads now (its `etcd_server_is_leader` is 1)."""
    for index, member in enumerate(cluster.members):
        if member.proc is None:
            continue
        url = f"http://{member.endpoint}/metrics"
        with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as answer:
            if re.search(r"^etcd_server_is_leader 1$", answer.read().decode(), re.MULTILINE):
                return index
    return None


def _post(member: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{member.endpoint}/v3/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=METRICS_TIMEOUT_S) as answer:
        return dict(json.loads(answer.read()))


def place_leader(cluster: Any, first_leads: bool) -> None:
    """Make the first-listed member (the one an EtcdStore asks first by default) the leader, or a
    follower: runs compare only with the same placement. etcd's own leadership transfer, asked
    of the leader; waits until the new leader says so."""
    current = leader(cluster)
    if current is None:
        raise RuntimeError("the etcd cluster has no leader")
    if (current == 0) == first_leads:
        return
    ids = {
        m["name"]: m["ID"] for m in _post(cluster.members[0], "cluster/member/list", {})["members"]
    }
    target = 0 if first_leads else next(i for i in range(1, len(cluster.members)) if i != current)
    target_id = ids[cluster.members[target].name]
    _post(cluster.members[current], "maintenance/transfer-leadership", {"targetID": target_id})
    deadline = time.monotonic() + LEADER_WAIT_S
    while leader(cluster) != target:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"etcd member {target} did not take the leadership")
        time.sleep(0.05)


def leader_changes(cluster: Any) -> int:
    """Leader changes the members have seen (the most any member saw; the first election
    counts one)."""
    seen = 0
    for text in _metrics_texts(cluster):
        found = re.search(r"^etcd_server_leader_changes_seen_total (\S+)$", text, re.MULTILINE)
        if found:
            seen = max(seen, int(float(found[1])))
    return seen


# ---- the stores, as one kind of server -------------------------------------------------------


class StoreServer:
    """A job's TCPStore, served by this process in threads of its own (libuv, no GIL), as the
    agent on the endpoint host serves it."""

    backend = "tcp"

    def __init__(self, timeout: datetime.timedelta = STORE_TIMEOUT) -> None:
        before = _thread_ids()
        self._store: dist.TCPStore | None = dist.TCPStore(
            HOST,
            0,
            is_master=True,
            multi_tenant=True,
            use_libuv=True,
            wait_for_workers=False,
            timeout=timeout,
        )
        self.port = self._store.port
        self._threads = _thread_ids() - before
        if not self._threads:
            raise RuntimeError("cannot find the store server's threads")

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def cpu_s(self) -> float:
        return sum(_thread_cpu_s(tid) for tid in self._threads)

    def requests(self) -> collections.Counter[str] | None:
        return None  # no counter of its own: the agents' operations are its requests

    def close(self) -> None:
        self._store = None  # the only reference: this ends the server


class EtcdServer:
    """The bench's etcd cluster, seen as one store (every user has its own run id, hence its
    own key prefix; the cluster outlives them, as it outlives jobs)."""

    backend = "etcd"

    def __init__(self, cluster: Any) -> None:
        self._cluster = cluster
        self.endpoint = ",".join(f"{h}:{p}" for h, p in member_addresses(cluster))

    def cpu_s(self) -> float:
        return members_cpu_s(self._cluster)

    def requests(self) -> collections.Counter[str] | None:
        return kv_requests(self._cluster)

    def close(self) -> None:
        pass


Server = StoreServer | EtcdServer


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _thread_cpu_s(tid: int) -> float:
    try:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    except FileNotFoundError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metrics_texts(cluster: Any) -> Iterator[str]:
    """Each running member's /metrics page."""
    for member in cluster.members:
        if member.proc is None:
            continue
        url = f"http://{member.endpoint}/metrics"
        with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as answer:
            yield answer.read().decode()
