"""Rendezvous at scale: N simulated agents against one real store, barrier vs dynamic, on a
TCPStore and on etcd.

    .venv/bin/python -m bench.rendezvous.rendezvous_scale --nodes 64,256,1024 --impl barrier,dynamic
    .venv/bin/python -m bench.rendezvous.rendezvous_scale --impl barrier --backend both
    .venv/bin/python -m bench.rendezvous.rendezvous_scale --backend both --smoke  # 8 nodes

`--backend tcp` (the default): a real libuv TCPStore served by this process on 127.0.0.1, as the
agent on the endpoint host serves it. `--backend etcd`: a real 3-member etcd cluster on
127.0.0.1 (tests/etcd_cluster.py's, started and stopped by this bench), each agent with its own
`EtcdStore` on all three members, as `--rdzv-backend=etcd` builds it. `both`: the same round on
each, interleaved round by round (the order alternating), with the etcd/tcp ratio pair by pair
and the floor beside it: one store call of each kind on an idle store, with etcd's own layers
under `EtcdStore` (an HTTP round trip, a serializable and a linearizable range, a put).

Every agent is a thread with its own store client, its own NodeDescriptor and its own
rendezvous object (no torch workers); the agents are spread over child processes of
`--threads-per-proc` threads each, because 1024 threads under one GIL measure the GIL, not the
rendezvous (see RESULTS.md). The agents connect and build their rendezvous objects first (timed
apart from the round), then all call `join` at a common start; the round time runs from that
start until the last agent has its Round. All Rounds must agree: same node order, group ranks
0..N-1 exactly once, each agent finding itself at its rank.

Store operations are counted per agent by a `torch.distributed.Store` subclass that forwards to
the client (pybind's trampoline makes it a real Store, so torch's C++ PrefixStore and the
dynamic handler go through it too). Each operation's start and end are kept; from them the
barrier round is split into phases. On etcd the requests behind those operations are counted by
etcd itself (its members' `grpc_server_handled_total`, and `grpc_server_started_total` of its
Watch service for the watch streams). `FTRUN_BENCH_TRACE_CLOSER=1` prints each call of the
agent(s) that closed the round: operation, start, duration, requests. The store server's CPU
time (the TCPStore's own threads; etcd: its three members' processes) is the cost all nodes
share; "CPU ms per node" is one agent thread's CPU time in `join`, what one real node would
spend.

All waits are bounded: a round that runs past `--cap` seconds is stopped through the
`interrupted` callback and reported as "> cap"; larger N of that implementation and backend are
skipped.
"""

from __future__ import annotations

import os

# Every timed-out 1 s store wait logs two C++ warnings; at 1024 agents that is noise and load.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# torch's c10d sockets reverse-resolve the peer address of every connection; where the resolver
# drops queries (this VM) each drop stalls a connect by glibc's default 5 s. Set-up only.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import argparse
import collections
import contextlib
import dataclasses
import datetime
import hashlib
import math
import multiprocessing
import queue
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from bench.common import exit_on_sigterm, smoke
from bench.common.report import Stats, pair_ratios, ratio_cell
from bench.common.timing import Stopwatch
from bench.rendezvous.store_floor import Floor, Plan, floor_report, measure_floors
from bench.rendezvous.stores import (
    HOST,
    STORE_TIMEOUT,
    EtcdMissing,
    EtcdServer,
    Server,
    StoreServer,
    etcd_cluster,
    leader,
    leader_changes,
    place_leader,
    requests_between,
)
from ftrun.config.rendezvous import RendezvousConfig, RendezvousImpl
from ftrun.rendezvous.barrier import BarrierRendezvousHandler, JoinInterruptedError
from ftrun.rendezvous.dynamic import DynamicRendezvous
from ftrun.rendezvous.ranks import NodeDescriptor, Round
from ftrun.store.etcd_members import spread_start
from ftrun.store.ops import add_then_wait_on, get_within, read_now

JOIN_TIMEOUT_S = 300.0
SETUP_TIMEOUT_S = 180.0
GRACE_S = 30.0  # for agents to notice a stop request, and for processes to exit
POLL_S = 0.1
TARGET_1024_S = 5.0
OPS = (
    "read_now", "check", "get", "set", "add", "add 0", "compare_set", "wait", "get_within",
    "multi_get", "multi_set", "other",
)  # fmt: skip
BACKENDS = ("tcp", "etcd")
CONNECT_KEY = "bench-connect"
"""A key no one writes: an etcd agent's first request (`connect_etcd` also makes one first)."""
Rendezvous = BarrierRendezvousHandler | DynamicRendezvous
OpLog = list[tuple[str, float, float, int]]
"""(op, start, end, requests): requests made to the store during the op (etcd; 0 for TCPStore,
whose every op is one request, two for `get` and `multi_get`: a wait first)."""


class BenchError(Exception):
    """The benchmark itself failed (not merely slow); the script exits non-zero."""


# ---- the counting store ----------------------------------------------------------------------


class CountingStore(dist.Store):
    """Forwards to one store client (a TCPStore or an EtcdStore); logs (op, start, end,
    requests) of every call (one agent only). `add` with 0 is logged as "add 0" (a read, by
    its meaning)."""

    def __init__(self, inner: dist.Store, requests: Callable[[], int] | None = None) -> None:
        super().__init__()
        self._inner = inner
        self._requests = requests or (lambda: 0)
        self.log: OpLog = []

    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        start, before = time.perf_counter(), self._requests()
        try:
            return fn(*args)
        finally:
            self.log.append((op, start, time.perf_counter(), self._requests() - before))

    def set(self, key: str, value: Any) -> None:
        self._call("set", self._inner.set, key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", self._inner.get, key)

    def add(self, key: str, value: int) -> int:
        return self._call("add" if value else "add 0", self._inner.add, key, value)

    def add_then_wait_on(self, key: str, watched: str) -> int:
        """The barrier's arrival (`ops.add_then_wait_on`: on etcd, with a look at the round's
        close in the same request)."""
        return self._call("add", add_then_wait_on, self._inner, key, watched)

    def read_now(self, keys: list[str]) -> list[bytes | None] | None:
        """A round's first look (`ops.read_now`: None on TCPStore, which reads otherwise)."""
        if not hasattr(self._inner, "read_now"):
            return None  # not an operation on this store: nothing to log
        return self._call("read_now", read_now, self._inner, keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", self._inner.compare_set, key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", self._inner.check, keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        args = (keys,) if timeout is None else (keys, timeout)
        self._call("wait", self._inner.wait, *args)

    def get_within(self, key: str, timeout_s: float) -> bytes | None:
        """The barrier's wait for the round (`ops.get_within`: on etcd, one watch that
        hands the value over; on TCPStore, a wait and a get)."""
        return self._call("get_within", get_within, self._inner, key, timeout_s)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", self._inner.multi_get, keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call("multi_set", self._inner.multi_set, keys, values)

    def delete_key(self, key: str) -> bool:
        return self._call("other", self._inner.delete_key, key)

    def num_keys(self) -> int:
        return self._call("other", self._inner.num_keys)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)


# ---- agents (in the child processes) ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcSpec:
    """What one child process simulates."""

    impl: RendezvousImpl
    nodes: int
    backend: str
    endpoint: str
    """tcp: `host:port`; etcd: `host:port,...`, the members (as `--rdzv-endpoint` gives them)."""
    run_id: str
    indices: tuple[int, ...]
    switch_interval: float
    spread: bool = True
    """etcd: agent i asks member i % 3 first, as launchers spread (`etcd_members.spread_start`);
    False: every agent asks the first-listed member first."""
    late_node_s: float = 0.0
    """The last agent joins this much after the common start (a node that starts late)."""

    def config(self) -> RendezvousConfig:
        return RendezvousConfig(
            endpoint=self.endpoint,
            run_id=self.run_id,
            min_nodes=self.nodes,
            max_nodes=self.nodes,
            impl=self.impl,
            backend="etcd" if self.backend == "etcd" else "c10d",
            join_timeout=JOIN_TIMEOUT_S,
            local_addr=HOST,
        )


@dataclasses.dataclass(frozen=True)
class RoundSummary:
    """What the parent checks of an agent's Round. Small: every agent's whole Round sent back
    is N x N descriptors to pickle (268 million at 16,384 nodes), the bench's own limit, not
    the rendezvous's."""

    number: int
    group_rank: int
    size: int
    nodes_digest: str
    """Of the nodes' names in group-rank order: equal digests, the same order."""
    me: NodeDescriptor

    @classmethod
    def of(cls, rnd: Round) -> RoundSummary:
        names = "\n".join(node.node for node in rnd.nodes).encode()
        digest = hashlib.blake2b(names, digest_size=16).hexdigest()
        return cls(rnd.number, rnd.group_rank, len(rnd.nodes), digest, rnd.me)


@dataclasses.dataclass
class AgentResult:
    """One agent's outcome, sent back to the parent."""

    index: int
    descriptor: NodeDescriptor
    round: RoundSummary | None = None
    end: float = 0.0
    cpu_s: float = 0.0
    """CPU time of this agent's thread in `join`."""
    log: OpLog = dataclasses.field(default_factory=list)
    """The join's store operations (construction does some too; they are left out)."""
    error: str | None = None
    interrupted: bool = False


@dataclasses.dataclass
class Agent:
    result: AgentResult
    store: CountingStore | None = None
    rdzv: Rendezvous | None = None
    skip: int = 0
    """Store operations before the join (the rendezvous object's construction)."""


@dataclasses.dataclass
class Local:
    """A child process's barriers (all connected, all built, common start), its stop flag and
    its line to the parent."""

    connected: threading.Barrier
    built: threading.Barrier
    start: threading.Barrier
    stop: threading.Event
    out: Any

    @classmethod
    def create(cls, agents: int, out: Any) -> Local:
        def barrier() -> threading.Barrier:
            return threading.Barrier(agents + 1, timeout=SETUP_TIMEOUT_S)

        return cls(barrier(), barrier(), barrier(), threading.Event(), out)

    def abort(self) -> None:
        for barrier in (self.connected, self.built, self.start):
            barrier.abort()


def descriptor(index: int) -> NodeDescriptor:
    return NodeDescriptor(
        node=f"node{index:04d}",
        host=f"10.{index // 65536}.{index // 256 % 256}.{index % 256}",
        local_world_size=8,
        master_port=29500,
    )


def build(spec: ProcSpec, store: CountingStore, mine: NodeDescriptor) -> Rendezvous:
    if spec.impl is RendezvousImpl.BARRIER:
        return BarrierRendezvousHandler(spec.config(), store, lambda: mine)
    return DynamicRendezvous(spec.config(), store, lambda: mine)


def open_store(spec: ProcSpec, index: int) -> CountingStore:
    """Agent `index`'s client, counted: a TCPStore connection, or an EtcdStore that has made its
    first request (as `connect_etcd` does before the agent uses it)."""
    if spec.backend == "etcd":
        members = [(h, int(p)) for h, p in (m.rsplit(":", 1) for m in spec.endpoint.split(","))]
        # The launchers' rule, with the agent's index for its pid (one process holds many).
        first = spread_start(len(members), index) if spec.spread else 0
        store = request_counting_etcd()(members, spec.run_id, STORE_TIMEOUT, first_member=first)
        store.check([CONNECT_KEY])
        return CountingStore(store, lambda: store.requests)
    port = int(spec.endpoint.rsplit(":", 1)[1])
    client = dist.TCPStore(HOST, port, is_master=False, timeout=STORE_TIMEOUT, use_libuv=True)
    return CountingStore(client)


_ETCD_STORE: list[type] = []


def request_counting_etcd() -> type:
    """ftrun's EtcdStore, counting its requests: each `_call` is one HTTP request while the
    members answer. The bench's attribution of etcd requests to store operations (etcd's own
    counters, read around the round, give the total)."""
    if not _ETCD_STORE:
        from ftrun.store.etcd_store import EtcdStore

        class RequestCountingEtcdStore(EtcdStore):
            requests = 0

            def _call(self, request: Callable[[Any], Any], *args: Any, **kwargs: Any) -> Any:
                # Whatever else EtcdStore passes (a watch's `answered`) goes through untouched:
                # the count must not depend on `_call`'s signature.
                self.requests += 1
                return super()._call(request, *args, **kwargs)

        _ETCD_STORE.append(RequestCountingEtcdStore)
    return _ETCD_STORE[0]


def agent_main(spec: ProcSpec, local: Local, agent: Agent) -> None:
    result = agent.result
    try:
        store = agent.store = open_store(spec, result.index)
        local.connected.wait()
        rdzv = agent.rdzv = build(spec, store, result.descriptor)
        agent.skip = len(store.log)
        local.built.wait()
        local.start.wait()
        if spec.late_node_s and result.index == spec.nodes - 1:
            local.stop.wait(spec.late_node_s)  # the others wait for it meanwhile
        cpu = time.thread_time()
        try:
            joined = rdzv.join(local.stop.is_set)
        finally:
            result.end = time.perf_counter()
            result.cpu_s = time.thread_time() - cpu
            result.log = store.log[agent.skip :]
        result.round = RoundSummary.of(joined)
    except BaseException as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.interrupted = isinstance(exc, JoinInterruptedError) or local.stop.is_set()
        if not result.interrupted:  # after a stop request, whatever happens is moot
            local.out.put(("failed", f"agent {result.index}: {result.error}"))
        local.abort()


def proc_main(spec: ProcSpec, number: int, go: Any, stop: Any, out: Any) -> None:
    """A child process: its agents connect and build, report ready, then join on `go`."""
    # A real agent has a GIL of its own; with many agents per interpreter, fewer forced switches
    # let one agent's decoding finish instead of all of them thrashing on the GIL.
    sys.setswitchinterval(spec.switch_interval)
    agents = [Agent(AgentResult(i, descriptor(i))) for i in spec.indices]
    local = Local.create(len(agents), out)
    threads = [
        threading.Thread(target=agent_main, args=(spec, local, a), daemon=True) for a in agents
    ]
    try:
        raise_fd_limit(len(agents), 2.0)
        connect_s = _proc_set_up(local, threads)
        out.put(("ready", number, connect_s, None))
        if not go.wait(SETUP_TIMEOUT_S):
            raise BenchError("no start signal from the parent")
        _barrier(local.start)
        _watch(threads, stop, local.stop)
    except BenchError as exc:
        local.abort()
        out.put(("ready", number, 0.0, _first_error(agents) or str(exc)))
    for agent in agents:  # one left inside a store call: its operations so far
        if agent.result.round is None and agent.store is not None and not agent.result.log:
            agent.result.log = list(agent.store.log[agent.skip :])
    out.put(("done", number, [a.result for a in agents]))
    _proc_clean_up(agents)


def _proc_set_up(local: Local, threads: Sequence[threading.Thread]) -> float:
    started = Stopwatch()
    for thread in threads:
        thread.start()
    _barrier(local.connected)
    connect_s = started.seconds()
    _barrier(local.built)
    return connect_s


def _barrier(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        raise BenchError("an agent failed before the round") from None


def _watch(threads: Sequence[threading.Thread], stop: Any, local_stop: threading.Event) -> None:
    """Wait for the agents; pass the parent's stop request on (bounded by the join timeout).

    An agent sees the request between its waits; one inside a store call that does not return
    (an etcd `add` retrying against a thousand others) is left behind after half the grace,
    so that the agents that did finish are reported."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S + GRACE_S
    for thread in threads:
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(POLL_S)
            if not local_stop.is_set() and stop.is_set():
                local_stop.set()
                deadline = min(deadline, time.monotonic() + GRACE_S / 2)


def _first_error(agents: Sequence[Agent]) -> str | None:
    errors = [f"agent {a.result.index}: {a.result.error}" for a in agents if a.result.error]
    return errors[0] if errors else None


def _proc_clean_up(agents: Sequence[Agent]) -> None:
    for agent in agents:
        if isinstance(agent.rdzv, DynamicRendezvous):
            # torch's keep-alive timer and rank 0's shared store server. `shutdown()` would also
            # run a close op through the contended state; the process ends right after this.
            agent.rdzv.handler._stop_heartbeats()
            agent.rdzv.handler._shared_tcp_store_server = None
        agent.rdzv = None
        agent.store = None


# ---- one round (in the parent) ---------------------------------------------------------------


@dataclasses.dataclass
class Result:
    impl: str
    backend: str
    nodes: int
    repeat: int
    procs: int
    connect_s: float
    round_s: float | None
    """None: stopped at the cap (or not run)."""
    server_cpu_s: float
    node_cpu_ms: list[float]
    ops: list[collections.Counter[str]]
    phases: dict[str, float]
    op_requests: list[collections.Counter[str]] = dataclasses.field(default_factory=list)
    """Per agent: the etcd requests its operations made, by operation."""
    op_seconds: list[collections.Counter[str]] = dataclasses.field(default_factory=list)
    """Per agent: the time spent in each kind of operation."""
    requests: dict[str, int] | None = None
    """etcd: the KV requests its members handled during the round, by method (all agents)."""
    arrived: int = 0
    """Barrier: agents whose arrival (`add` to the arrivals counter) had returned by the end."""
    note: str | None = None
    """Why there is no round: it failed (`failed`), or it was not run."""
    failed: bool = False

    @staticmethod
    def not_run(impl: str, backend: str, nodes: int, why: str) -> Result:
        return Result(impl, backend, nodes, 0, 0, 0.0, None, 0.0, [], [], {}, note=why)

    @staticmethod
    def failure(impl: str, backend: str, nodes: int, repeat: int, error: str) -> Result:
        result = Result(impl, backend, nodes, repeat, 0, 0.0, None, 0.0, [], [], {}, note=error)
        result.failed = True
        return result


@dataclasses.dataclass
class Children:
    procs: list[BaseProcess]
    go: Any
    stop: Any
    out: Any


_CONTEXT: list[ForkServerContext] = []


def context(backends: Sequence[str] = ("tcp",)) -> ForkServerContext:
    """Children fork from a server that has torch imported already (and no threads)."""
    if not _CONTEXT:
        ctx = multiprocessing.get_context("forkserver")
        preload = ["torch.distributed", "ftrun.rendezvous.barrier", "ftrun.rendezvous.dynamic"]
        if "etcd" in backends:
            preload.append("ftrun.store.etcd_store")
        ctx.set_forkserver_preload(preload)
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def run_round(
    impl: RendezvousImpl, backend: str, nodes: int, repeat: int, args: argparse.Namespace
) -> Result:
    server: Server = StoreServer() if backend == "tcp" else EtcdServer(args.etcd)
    ctx = context(args.backend)
    procs = math.ceil(nodes / args.threads_per_proc)
    children = Children([], ctx.Event(), ctx.Event(), ctx.Queue())
    run_id = f"scale-{impl.value}-{backend}-{nodes}-{repeat}"
    try:
        for number in range(procs):
            indices = tuple(range(number, nodes, procs))
            spec = ProcSpec(impl, nodes, backend, server.endpoint, run_id, indices,
                            args.switch_interval, spread=args.etcd_spread == "node",
                            late_node_s=args.late_node_s)  # fmt: skip
            proc_args = (spec, number, children.go, children.stop, children.out)
            children.procs.append(ctx.Process(target=proc_main, args=proc_args, daemon=True))
            children.procs[-1].start()
        result = _drive(impl, nodes, server, children, args.cap)
        result.repeat = repeat
        return result
    finally:
        children.stop.set()
        _end_children(children)
        server.close()


def _drive(
    impl: RendezvousImpl, nodes: int, server: Server, children: Children, cap: float
) -> Result:
    ready = _collect(children, "ready", time.monotonic() + SETUP_TIMEOUT_S)
    failed = [msg[3] for msg in ready if msg[3]]
    if failed or len(ready) < len(children.procs):
        raise BenchError(f"agents could not set up: {failed[0] if failed else 'timed out'}")
    requests0 = server.requests()
    cpu0 = server.cpu_s()
    t0 = time.perf_counter()
    children.go.set()
    done = _collect(children, "done", time.monotonic() + cap)
    capped = len(done) < len(children.procs)
    if capped:
        children.stop.set()
        done += _collect(children, "done", time.monotonic() + GRACE_S, len(done))
    server_cpu = server.cpu_s() - cpu0
    requests1 = server.requests()
    agents = sorted((a for msg in done for a in msg[2]), key=lambda a: a.index)
    _raise_agent_errors(agents, nodes, capped)
    if not capped:
        verify(agents)
    finished = [a for a in agents if a.round is not None]
    requests = None
    if requests0 is not None and requests1 is not None:
        requests = requests_between(requests0, requests1)
    return Result(
        impl=impl.value,
        backend=server.backend,
        nodes=nodes,
        repeat=0,
        procs=len(children.procs),
        connect_s=max(msg[2] for msg in ready),
        round_s=None if capped else max(a.end for a in agents) - t0,
        server_cpu_s=server_cpu,
        node_cpu_ms=[a.cpu_s * 1e3 for a in finished],
        ops=[collections.Counter(op for op, *_ in a.log) for a in agents],
        op_requests=[_sums(a.log, lambda e: e[3]) for a in agents],
        op_seconds=[_sums(a.log, lambda e: e[2] - e[1]) for a in agents],
        phases=barrier_phases(agents, t0) if impl is RendezvousImpl.BARRIER and not capped else {},
        requests=requests,
        arrived=sum(1 for a in agents if any(e[0] == "add" for e in a.log)),
    )


def _sums(log: OpLog, value: Callable[[Any], float]) -> collections.Counter[str]:
    sums: collections.Counter[str] = collections.Counter()
    for entry in log:
        sums[entry[0]] += value(entry)
    return sums


def _collect(children: Children, kind: str, deadline: float, have: int = 0) -> list[Any]:
    """The children's `kind` messages until all came or `deadline`; fails fast on a crash."""
    messages: list[Any] = []
    while have + len(messages) < len(children.procs) and time.monotonic() < deadline:
        try:
            msg = children.out.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            crashed = [p.exitcode for p in children.procs if p.exitcode not in (None, 0)]
            if crashed:
                raise BenchError(f"an agent process died (exit code {crashed[0]})") from None
            continue
        if msg[0] == kind:
            messages.append(msg)
        elif msg[0] == "failed" or (msg[0] == "ready" and msg[3]):
            raise BenchError(f"{msg[-1]}")
    return messages


def _end_children(children: Children) -> None:
    deadline = time.monotonic() + GRACE_S
    for proc in children.procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in children.procs:
        if proc.is_alive():
            proc.kill()
            proc.join(GRACE_S)
    children.out.close()
    children.out.join_thread()


def _raise_agent_errors(agents: Sequence[AgentResult], nodes: int, capped: bool) -> None:
    if len(agents) != nodes:
        raise BenchError(f"{len(agents)} of {nodes} agents reported back")
    for agent in agents:
        if agent.error and not (capped and agent.interrupted):
            raise BenchError(f"agent {agent.index} failed: {agent.error}")
        if agent.round is None and not capped:
            raise BenchError(f"agent {agent.index} returned no Round")


def verify(agents: Sequence[AgentResult]) -> None:
    """Every agent holds the same Round: same number and order, ranks 0..N-1 exactly once (N
    nodes, each agent itself at its own rank: the round holds every agent once)."""
    rounds = [a.round for a in agents if a.round is not None]
    first = rounds[0]
    if first.size != len(agents):
        raise BenchError(f"the round has {first.size} nodes, not the {len(agents)} agents")
    for agent in agents:
        rnd = agent.round
        assert rnd is not None
        if rnd.number != first.number or rnd.nodes_digest != first.nodes_digest:
            raise BenchError(f"agent {agent.index} disagrees on the round")
        if rnd.me != agent.descriptor:
            raise BenchError(f"agent {agent.index} is not at its group rank {rnd.group_rank}")
    if sorted(r.group_rank for r in rounds) != list(range(len(agents))):
        raise BenchError("group ranks are not 0..N-1 exactly once")


def barrier_phases(agents: Sequence[AgentResult], t0: float) -> dict[str, float]:
    """Where the barrier round's time goes (seconds after the common start).

    A barrier join: check (shutdown), get (cycle), add (arrival), set (descriptor),
    [multi_get, compare_set (the closer publishes the round as it closes it)], get_within...
    (the waits for the round; the last one returns it: on etcd from the watch's event, on
    TCPStore by a get after the wait), then decoding and ordering in Python."""
    if os.environ.get("FTRUN_BENCH_TRACE_CLOSER"):  # the closer's own calls, one a line
        for a in agents:
            if any(e[0] == "compare_set" for e in a.log):
                for op, start, end, req in a.log:
                    print(f"closer {op} +{start - t0:.3f}s {end - start:.3f}s {req} req",
                          file=sys.stderr)  # fmt: skip
    first_op = [a.log[0][1] - t0 for a in agents]
    arrived = [next(e for e in a.log if e[0] == "add")[2] - t0 for a in agents]
    closed = [e[2] - t0 for a in agents for e in a.log if e[0] == "compare_set"]
    woke = [[e for e in a.log if e[0] in ("wait", "get_within")][-1][2] - t0 for a in agents]
    final = [a.log[-1] for a in agents]
    fetch = [end - start for _, start, end, _ in final]
    local = [a.end - entry[2] for a, entry in zip(agents, final, strict=True)]
    return {
        "first join op starts (median)": statistics.median(first_op),
        "last arrival (add) done": max(arrived),
        "round closed (compare_set)": max(closed),
        "last wake-up (wait returns)": max(woke),
        "final read (get round), median per node": statistics.median(fetch),
        "final read, max": max(fetch),
        "last final read done": max(e[2] for e in final) - t0,
        "decode+order, median per node": statistics.median(local),
        "last agent done": max(a.end for a in agents) - t0,
    }


# ---- reporting -------------------------------------------------------------------------------


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary_rows(results: Sequence[Result], cap: float) -> list[list[str]]:
    rows = []
    for (impl, backend, nodes), group in _grouped(results).items():
        round_cell = _round_cell(group, cap)
        totals = [sum(c.values()) for r in group for c in r.ops]
        node_cpu = [ms for r in group for ms in r.node_cpu_ms]
        ran = [r for r in group if r.procs]
        rows.append(
            [
                impl,
                backend,
                str(nodes),
                f"{len(ran)} x {ran[0].procs}" if ran else "not run",
                fmt_s(statistics.median(r.connect_s for r in ran)) if ran else "-",
                round_cell,
                fmt_s(statistics.median(r.server_cpu_s for r in ran)) if ran else "-",
                f"{statistics.median(node_cpu):.1f}" if node_cpu else "-",
                f"{statistics.mean(totals):.1f}" if totals else "-",
                str(max(totals)) if totals else "-",
            ]
        )
    return rows


def _round_cell(group: Sequence[Result], cap: float) -> str:
    stopped = [r for r in group if r.note]
    if stopped:
        return f"failed: {stopped[0].note}" if stopped[0].failed else stopped[0].note or ""
    capped = [r for r in group if r.round_s is None]
    if capped:
        rounds = "/".join(str(len(r.node_cpu_ms)) for r in capped)
        arrived = "/".join(str(r.arrived) for r in capped)
        cell = f"> {cap:.0f} (cap, {len(capped)} of {len(group)} runs; of {group[0].nodes}, "
        cell += f"{rounds} had a Round"
        if group[0].impl == "barrier":
            cell += f", {arrived} had arrived"
        done = [r.round_s for r in group if r.round_s is not None]
        if done:
            cell += f"; the others: {', '.join(f'{s:.2f}' for s in done)}"
        return cell + ")"
    done = [r.round_s for r in group if r.round_s is not None]
    return f"{statistics.median(done):.2f} ({min(done):.2f}-{max(done):.2f})"


def ratio_rows(results: Sequence[Result]) -> list[list[str]]:
    """etcd beside TCPStore, per implementation and N: the round and the CPU, pair by pair
    (run i on etcd / run i on TCPStore)."""
    groups = _grouped(results)
    rows = []
    for impl, nodes in dict.fromkeys((i, n) for i, _, n in groups):
        tcp, etcd = groups.get((impl, "tcp", nodes)), groups.get((impl, "etcd", nodes))
        if not tcp or not etcd:
            continue
        cells = [impl, str(nodes)]
        for measure in (_round_s, _server_cpu_s, _node_cpu_ms):
            ours, peer = measure(etcd), measure(tcp)
            for group, values in ((tcp, peer), (etcd, ours)):
                stats = Stats.of(list(values.values()))
                cells.append((stats.cell() if stats else "-") + _unfinished(group))
            cells.append(ratio_cell(pair_ratios(ours, peer)))
        rows.append(cells)
    return rows


def _unfinished(group: Sequence[Result]) -> str:
    """ ", 2 of 3 runs > cap" where some runs have no round (past the cap, failed, not run)."""
    missing = [r for r in group if r.round_s is None]
    return f", {len(missing)} of {len(group)} runs without a round" if missing else ""


def _round_s(group: Sequence[Result]) -> dict[int, float | None]:
    return {r.repeat: r.round_s for r in group if r.procs}


def _server_cpu_s(group: Sequence[Result]) -> dict[int, float | None]:
    return {r.repeat: r.server_cpu_s for r in group if r.procs and r.round_s is not None}


def _node_cpu_ms(group: Sequence[Result]) -> dict[int, float | None]:
    return {
        r.repeat: statistics.median(r.node_cpu_ms)
        for r in group
        if r.node_cpu_ms and r.round_s is not None
    }


def op_rows(results: Sequence[Result]) -> list[list[str]]:
    """Per (impl, store, N): each operation's count per node (mean/max), the etcd requests it
    made per node (mean) and the time a node spent in it (mean); then etcd's own count of the
    requests per node, by method."""
    rows = []
    for (impl, backend, nodes), group in _grouped(results).items():
        counters = [c for r in group for c in r.ops]
        requests = [c for r in group for c in r.op_requests]
        seconds = [c for r in group for c in r.op_seconds]
        cells = []
        for op in OPS:
            values = [c[op] for c in counters]
            if not any(values):
                continue
            cell = f"{op} {statistics.mean(values):.2f}/{max(values)}"
            if any(c[op] for c in requests):
                cell += f" ({statistics.mean(c[op] for c in requests):.1f} req)"
            cells.append(f"{cell} {statistics.mean(c[op] for c in seconds) * 1e3:.0f} ms")
        counted = "-"
        ran = [r for r in group if r.requests]
        if ran:
            methods = sorted({m for r in ran for m in r.requests or {}})
            per_node = [
                f"{m} {statistics.median((r.requests or {}).get(m, 0) / nodes for r in ran):.1f}"
                for m in methods
            ]
            total = statistics.median(sum((r.requests or {}).values()) / nodes for r in ran)
            counted = f"{total:.1f}: " + ", ".join(per_node)
        rows.append([impl, backend, str(nodes), ", ".join(cells) or "-", counted])
    return rows


def phase_rows(results: Sequence[Result]) -> list[list[str]]:
    groups = {key: [r for r in group if r.phases] for key, group in _grouped(results).items()}
    groups = {key: group for key, group in groups.items() if group}
    if not groups:
        return []
    names = list(next(iter(groups.values()))[0].phases)
    rows = []
    for name in names:
        cells = [
            f"{statistics.median(r.phases[name] for r in group):.3f}" for group in groups.values()
        ]
        rows.append([name, *cells])
    return [["phase", *(f"{impl} {b} N={n}" for impl, b, n in groups)], *rows]


def _grouped(results: Sequence[Result]) -> dict[tuple[str, str, int], list[Result]]:
    groups: dict[tuple[str, str, int], list[Result]] = {}
    for result in results:
        groups.setdefault((result.impl, result.backend, result.nodes), []).append(result)
    return groups


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def report(results: Sequence[Result], cap: float) -> str:
    header = [
        "impl",
        "store",
        "N",
        "runs x procs",
        "connect s",
        "round s median (min-max)",
        "store server CPU s",
        "CPU ms per node (median)",
        "store ops per node mean",
        "max",
    ]
    text = markdown(header, summary_rows(results, cap))
    ratios = ratio_rows(results)
    if ratios:
        header = ["impl", "N", "round s, tcp", "etcd", "etcd/tcp, pair by pair"]
        header += ["store CPU s, tcp", "etcd", "etcd/tcp"]
        header += ["CPU ms per node, tcp", "etcd", "etcd/tcp"]
        text += "\n\netcd beside TCPStore, median (min-max) of runs; ratios run by run:\n\n"
        text += markdown(header, ratios)
    ops = markdown(
        [
            "impl",
            "store",
            "N",
            "op: count per node mean/max (etcd requests per node) time per node",
            "etcd's count: requests per node (median of runs), by method",
        ],
        op_rows(results),
    )
    text += f"\n\nStore operations per node in one join (means over nodes and runs):\n\n{ops}\n"
    phases = phase_rows(results)
    if phases:
        text += "\nBarrier round phases, seconds after the common start (median of runs):\n\n"
        text += markdown(phases[0], phases[1:]) + "\n"
    return text


# ---- main ------------------------------------------------------------------------------------


def raise_fd_limit(agents: int, per_agent: float = 1.0) -> None:
    """File descriptors for `agents` agents at `per_agent` each, plus slack. A child process
    holds one client socket per agent thread; this process serves the TCPStore (one socket
    per agent), and an etcd member, which inherits this limit, about two per agent that asks it
    (a request and a watch): a third of them where the agents spread over the members."""
    need = int(per_agent * agents) + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        try:  # a privileged user (root on the device) may raise the hard limit itself
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            return
        except (ValueError, OSError):
            raise BenchError(
                f"{agents} agents need {need} file descriptors; the hard limit is {hard}"
            ) from None
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def repeats_for(nodes: int, backend: str, args: argparse.Namespace) -> int:
    if backend == "etcd" and nodes >= 1024 and args.etcd_repeats_1024:
        return args.etcd_repeats_1024
    return args.repeats


def run_all(args: argparse.Namespace) -> list[Result]:
    """Every (implementation, N) on each backend, the backends interleaved round by round
    (their order alternating); past the cap, larger N of that implementation and backend are
    skipped."""
    results: list[Result] = []
    stopped: dict[tuple[str, str], str] = {}
    """(impl, backend) -> why larger N are not run."""
    for impl in args.impl:
        for nodes in args.nodes:
            repeats = max(repeats_for(nodes, b, args) for b in args.backend)
            for repeat in range(repeats):
                order = args.backend if repeat % 2 == 0 else args.backend[::-1]
                for backend in order:
                    key = (impl.value, backend)
                    if repeat >= repeats_for(nodes, backend, args):
                        continue
                    if key in stopped:
                        if repeat == 0:
                            print(f"{impl.value} {backend} N={nodes}: {stopped[key]}")
                            results.append(Result.not_run(*key, nodes, stopped[key]))
                        continue
                    try:
                        result = run_round(impl, backend, nodes, repeat, args)
                    except BenchError as exc:
                        print(f"{impl.value} {backend} N={nodes} run {repeat}: FAILED: {exc}")
                        results.append(Result.failure(*key, nodes, repeat, str(exc)))
                        stopped[key] = f"not run (N={nodes} failed)"
                        continue
                    results.append(result)
                    print(
                        f"{impl.value} {backend} N={nodes} run {repeat}: {result.procs} "
                        f"process(es), connect {result.connect_s:.2f} s, round "
                        f"{fmt_s(result.round_s)} s, store server CPU "
                        f"{result.server_cpu_s:.2f} s",
                        flush=True,
                    )
                    if result.round_s is None and not args.keep_going:
                        stopped[key] = f"> {args.cap:.0f} (cap; not run)"
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", default="64,256,1024", help="comma-separated N")
    parser.add_argument("--impl", default="barrier,dynamic", help="barrier, dynamic or both")
    parser.add_argument(
        "--backend",
        default="tcp",
        choices=["tcp", "etcd", "both"],
        help="the store: a TCPStore, a 3-member etcd cluster (started here), or both, "
        "interleaved round by round",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds per N (median reported)")
    parser.add_argument(
        "--etcd-repeats-1024",
        type=int,
        default=0,
        help="rounds on etcd at N >= 1024 (0: --repeats; at least 3)",
    )
    parser.add_argument("--cap", type=float, default=120.0, help="seconds before '> cap'")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="run larger N after a round ran past the cap (default: skip them)",
    )
    parser.add_argument(
        "--threads-per-proc", type=int, default=128, help="agents per child process"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=0.05,
        help="sys.setswitchinterval in the agent processes (Python's default: 0.005)",
    )
    parser.add_argument(
        "--floor-calls", type=int, default=200, help="calls per floor block (0: no floor)"
    )
    parser.add_argument("--floor-blocks", type=int, default=5, help="floor blocks per backend")
    parser.add_argument(
        "--etcd-spread",
        choices=["node", "first"],
        default="node",
        help="which etcd member an agent asks first: node i member i %% 3, as launchers spread "
        "over the members (the default), or the first-listed one for every agent (before)",
    )
    parser.add_argument(
        "--etcd-first",
        choices=["follower", "leader"],
        default="follower",
        help="the first-listed etcd member (the floor's, and every agent's first with "
        "--etcd-spread first): a follower (as it is 2 times in 3) or the leader; the bench "
        "moves the leadership to make it so",
    )
    parser.add_argument(
        "--late-node-s",
        type=float,
        default=0.0,
        help="the last node joins this many seconds after the others, which wait for it (a node "
        "that starts late): what waiting costs the store; the round's time includes it",
    )
    sizes = {"nodes": "8", "repeats": 1, "threads_per_proc": 8, "floor_calls": 10,
             "floor_blocks": 1, "cap": 60.0}  # fmt: skip
    args = smoke.parse_args(parser, sizes, argv)
    try:
        args.nodes = [int(n) for n in args.nodes.split(",")]
        args.impl = [RendezvousImpl(name) for name in args.impl.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    args.backend = list(BACKENDS) if args.backend == "both" else [args.backend]
    if min(args.nodes) < 1 or args.threads_per_proc < 1 or args.repeats < 1 or args.cap <= 0:
        parser.error("--nodes, --threads-per-proc, --repeats and --cap must be positive")
    if args.etcd_repeats_1024 and args.etcd_repeats_1024 < 3:
        parser.error("--etcd-repeats-1024: at least 3 (a median of fewer says little)")
    if args.floor_calls < 0 or args.floor_blocks < 1:
        parser.error("--floor-calls must be >= 0 and --floor-blocks positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()  # the etcd members and the agent processes go with the bench
    load = os.getloadavg()[0]
    floors: list[Floor] = []
    lead, changes = None, 0
    try:
        # Before etcd starts: its members inherit the limit.
        raise_fd_limit(max(args.nodes), 1.0 if args.etcd_spread == "node" else 2.0)
        with contextlib.ExitStack() as stack:
            args.etcd = stack.enter_context(etcd_cluster()) if "etcd" in args.backend else None
            if args.etcd is not None:
                place_leader(args.etcd, first_leads=args.etcd_first == "leader")
            if args.floor_calls:
                plan = Plan(args.floor_calls, args.floor_blocks)
                floors = measure_floors(args.backend, args.etcd, plan)
            results = run_all(args)
            if args.etcd is not None:
                lead, changes = leader(args.etcd), leader_changes(args.etcd)
    except (BenchError, EtcdMissing, AssertionError, RuntimeError, OSError) as exc:
        print(f"rendezvous_scale: FAILED: {exc}", file=sys.stderr)
        return 1
    print()
    print(report(results, args.cap))
    if floors:
        print("One store call on an idle store (the floor):\n")
        print(floor_report(floors, Plan(args.floor_calls, args.floor_blocks)))
    if args.etcd is not None:
        where = "the leader" if lead == 0 else f"a follower (member {lead} leads)"
        spread = ("agent i asks member i % 3 first" if args.etcd_spread == "node"
                  else "every agent asks the first-listed member first")  # fmt: skip
        print(f"etcd: 3 members on 127.0.0.1, etcd's defaults; {spread}; the first-listed "
              f"member: {args.etcd_first} at the start, {where} at the end; leader changes seen: "
              f"{changes} (the first election and the bench's move count)")  # fmt: skip
    print(
        f"machine: {os.cpu_count()} cores; 1-min load average {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end"
    )
    report_target(results)
    return 1 if any(r.failed for r in results) else 0


def report_target(results: Sequence[Result]) -> None:
    for backend in BACKENDS:
        key = ("barrier", backend, 1024)
        big = [r.round_s for r in results if (r.impl, r.backend, r.nodes) == key]
        if not big:
            continue
        if any(s is None for s in big):
            print(f"barrier on {backend}, 1024 nodes: no round (cap, failure or not run); MISSES "
                  f"the {TARGET_1024_S:.0f} s target")  # fmt: skip
            continue
        median = statistics.median(s for s in big if s is not None)
        verdict = "meets" if median <= TARGET_1024_S else "MISSES"
        print(f"barrier on {backend}, 1024 nodes: {median:.2f} s {verdict} the "
              f"{TARGET_1024_S:.0f} s target")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
