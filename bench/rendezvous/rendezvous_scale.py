"""Rendezvous at scale: N simulated agents against one real TCPStore, barrier vs dynamic.

    .venv/bin/python bench/rendezvous/rendezvous_scale.py --nodes 64,256,1024 --impl barrier,dynamic

The store is a real libuv TCPStore served by this process on 127.0.0.1. Every agent is a thread
with its own TCPStore client connection, its own NodeDescriptor and its own rendezvous object
(no torch workers); the agents are spread over child processes of `--threads-per-proc` threads
each, because 1024 threads under one GIL measure the GIL, not the rendezvous (see RESULTS.md).
The agents connect and build their rendezvous objects first (timed apart from the round), then
all call `join` at a common start; the round time runs from that start until the last agent has
its Round. All Rounds must agree: same node order, group ranks 0..N-1 exactly once, each agent
finding itself at its rank.

Store operations are counted per agent by a `torch.distributed.Store` subclass that forwards to
the client (pybind's trampoline makes it a real Store, so torch's C++ PrefixStore and the
dynamic handler go through it too). Each operation's start and end are kept; from them the
barrier round is split into phases. The store server's CPU time (its own threads) is the cost
all nodes share; "CPU ms per node" is one agent thread's CPU time in `join`, what one real node
would spend.

All waits are bounded: a round that runs past `--cap` seconds is stopped through the
`interrupted` callback and reported as "> cap"; larger N of that implementation are skipped.
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
import dataclasses
import datetime
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
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ftrun.rendezvous.barrier import BarrierRendezvousHandler, JoinInterruptedError
from ftrun.rendezvous.config import RendezvousConfig, RendezvousImpl
from ftrun.rendezvous.dynamic import DynamicRendezvous
from ftrun.rendezvous.ranks import NodeDescriptor, Round

HOST = "127.0.0.1"
JOIN_TIMEOUT_S = 300.0
STORE_TIMEOUT = datetime.timedelta(seconds=120)
SETUP_TIMEOUT_S = 180.0
GRACE_S = 30.0  # for agents to notice a stop request, and for processes to exit
POLL_S = 0.1
TARGET_1024_S = 5.0
OPS = ("check", "get", "set", "add", "compare_set", "wait", "multi_get", "multi_set", "other")
Rendezvous = BarrierRendezvousHandler | DynamicRendezvous
OpLog = list[tuple[str, float, float]]


class BenchError(Exception):
    """The benchmark itself failed (not merely slow); the script exits non-zero."""


# ---- the counting store ----------------------------------------------------------------------


class CountingStore(dist.Store):
    """Forwards to one TCPStore client; logs (op, start, end) of every call (one agent only)."""

    def __init__(self, inner: dist.TCPStore) -> None:
        super().__init__()
        self._inner = inner
        self.log: OpLog = []

    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.log.append((op, start, time.perf_counter()))

    def set(self, key: str, value: Any) -> None:
        self._call("set", self._inner.set, key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", self._inner.get, key)

    def add(self, key: str, value: int) -> int:
        return self._call("add", self._inner.add, key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", self._inner.compare_set, key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", self._inner.check, keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        args = (keys,) if timeout is None else (keys, timeout)
        self._call("wait", self._inner.wait, *args)

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


# ---- the store server ------------------------------------------------------------------------


class StoreServer:
    """The job's TCPStore, served by this process in threads of its own (libuv, no GIL)."""

    def __init__(self) -> None:
        before = _thread_ids()
        self._store: dist.TCPStore | None = dist.TCPStore(
            HOST,
            0,
            is_master=True,
            multi_tenant=True,
            use_libuv=True,
            wait_for_workers=False,
            timeout=STORE_TIMEOUT,
        )
        self.port = self._store.port
        self._threads = _thread_ids() - before
        if not self._threads:
            raise BenchError("cannot find the store server's threads")

    def cpu_s(self) -> float:
        return sum(_thread_cpu_s(tid) for tid in self._threads)

    def close(self) -> None:
        self._store = None  # the only reference: this ends the server


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _thread_cpu_s(tid: int) -> float:
    try:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    except FileNotFoundError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- agents (in the child processes) ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcSpec:
    """What one child process simulates."""

    impl: RendezvousImpl
    nodes: int
    port: int
    run_id: str
    indices: tuple[int, ...]
    switch_interval: float

    def config(self) -> RendezvousConfig:
        return RendezvousConfig(
            endpoint=f"{HOST}:{self.port}",
            run_id=self.run_id,
            min_nodes=self.nodes,
            max_nodes=self.nodes,
            impl=self.impl,
            join_timeout=JOIN_TIMEOUT_S,
            local_addr=HOST,
        )


@dataclasses.dataclass
class AgentResult:
    """One agent's outcome, sent back to the parent."""

    index: int
    descriptor: NodeDescriptor
    round: Round | None = None
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


def agent_main(spec: ProcSpec, local: Local, agent: Agent) -> None:
    result = agent.result
    try:
        client = dist.TCPStore(
            HOST, spec.port, is_master=False, timeout=STORE_TIMEOUT, use_libuv=True
        )
        agent.store = CountingStore(client)
        local.connected.wait()
        agent.rdzv = build(spec, agent.store, result.descriptor)
        skip = len(agent.store.log)
        local.built.wait()
        local.start.wait()
        cpu = time.thread_time()
        try:
            result.round = agent.rdzv.join(local.stop.is_set)
        finally:
            result.end = time.perf_counter()
            result.cpu_s = time.thread_time() - cpu
            result.log = agent.store.log[skip:]
    except BaseException as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.interrupted = isinstance(exc, JoinInterruptedError)
        if not result.interrupted:
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
        raise_fd_limit(len(agents))
        connect_s = _proc_set_up(local, threads)
        out.put(("ready", number, connect_s, None))
        if not go.wait(SETUP_TIMEOUT_S):
            raise BenchError("no start signal from the parent")
        _barrier(local.start)
        _watch(threads, stop, local.stop)
    except BenchError as exc:
        local.abort()
        out.put(("ready", number, 0.0, _first_error(agents) or str(exc)))
    out.put(("done", number, [a.result for a in agents]))
    _proc_clean_up(agents)


def _proc_set_up(local: Local, threads: Sequence[threading.Thread]) -> float:
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    _barrier(local.connected)
    connect_s = time.perf_counter() - started
    _barrier(local.built)
    return connect_s


def _barrier(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        raise BenchError("an agent failed before the round") from None


def _watch(threads: Sequence[threading.Thread], stop: Any, local_stop: threading.Event) -> None:
    """Wait for the agents; pass the parent's stop request on (bounded by the join timeout)."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S + GRACE_S
    for thread in threads:
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(POLL_S)
            if not local_stop.is_set() and stop.is_set():
                local_stop.set()


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
    nodes: int
    procs: int
    connect_s: float
    round_s: float | None
    """None: stopped at the cap (or not run)."""
    server_cpu_s: float
    node_cpu_ms: list[float]
    ops: list[collections.Counter[str]]
    phases: dict[str, float]


@dataclasses.dataclass
class Children:
    procs: list[BaseProcess]
    go: Any
    stop: Any
    out: Any


_CONTEXT: list[ForkServerContext] = []


def context() -> ForkServerContext:
    """Children fork from a server that has torch imported already (and no threads)."""
    if not _CONTEXT:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["torch.distributed", "ftrun.rendezvous.barrier", "ftrun.rendezvous.dynamic"]
        )
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def run_round(impl: RendezvousImpl, nodes: int, repeat: int, args: argparse.Namespace) -> Result:
    server = StoreServer()
    ctx = context()
    procs = math.ceil(nodes / args.threads_per_proc)
    children = Children([], ctx.Event(), ctx.Event(), ctx.Queue())
    try:
        for number in range(procs):
            indices = tuple(range(number, nodes, procs))
            run_id = f"scale-{impl.value}-{nodes}-{repeat}"
            spec = ProcSpec(impl, nodes, server.port, run_id, indices, args.switch_interval)
            proc_args = (spec, number, children.go, children.stop, children.out)
            children.procs.append(ctx.Process(target=proc_main, args=proc_args, daemon=True))
            children.procs[-1].start()
        return _drive(impl, nodes, server, children, args.cap)
    finally:
        children.stop.set()
        _end_children(children)
        server.close()


def _drive(
    impl: RendezvousImpl, nodes: int, server: StoreServer, children: Children, cap: float
) -> Result:
    ready = _collect(children, "ready", time.monotonic() + SETUP_TIMEOUT_S)
    failed = [msg[3] for msg in ready if msg[3]]
    if failed or len(ready) < len(children.procs):
        raise BenchError(f"agents could not set up: {failed[0] if failed else 'timed out'}")
    cpu0 = server.cpu_s()
    t0 = time.perf_counter()
    children.go.set()
    done = _collect(children, "done", time.monotonic() + cap)
    capped = len(done) < len(children.procs)
    if capped:
        children.stop.set()
        done += _collect(children, "done", time.monotonic() + GRACE_S, len(done))
    server_cpu = server.cpu_s() - cpu0
    agents = sorted((a for msg in done for a in msg[2]), key=lambda a: a.index)
    _raise_agent_errors(agents, nodes, capped)
    if not capped:
        verify(agents)
    finished = [a for a in agents if a.round is not None]
    return Result(
        impl=impl.value,
        nodes=nodes,
        procs=len(children.procs),
        connect_s=max(msg[2] for msg in ready),
        round_s=None if capped else max(a.end for a in agents) - t0,
        server_cpu_s=server_cpu,
        node_cpu_ms=[a.cpu_s * 1e3 for a in finished],
        ops=[collections.Counter(op for op, _, _ in a.log) for a in agents],
        phases=barrier_phases(agents, t0) if impl is RendezvousImpl.BARRIER and not capped else {},
    )


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
    """Every agent holds the same Round: same number and order, ranks 0..N-1 exactly once."""
    rounds = [a.round for a in agents if a.round is not None]
    first = rounds[0]
    if len(first.nodes) != len(agents) or set(first.nodes) != {a.descriptor for a in agents}:
        raise BenchError(f"the round has {len(first.nodes)} nodes, not the {len(agents)} agents")
    for agent in agents:
        rnd = agent.round
        assert rnd is not None
        if rnd.number != first.number or rnd.nodes != first.nodes:
            raise BenchError(f"agent {agent.index} disagrees on the round")
        if rnd.me != agent.descriptor:
            raise BenchError(f"agent {agent.index} is not at its group rank {rnd.group_rank}")
    if sorted(r.group_rank for r in rounds) != list(range(len(agents))):
        raise BenchError("group ranks are not 0..N-1 exactly once")


def barrier_phases(agents: Sequence[AgentResult], t0: float) -> dict[str, float]:
    """Where the barrier round's time goes (seconds after the common start).

    A barrier join: check (shutdown), get (cycle), add (arrival), set (descriptor),
    [multi_get, set, compare_set (the closer publishes the round and closes it)], wait...,
    get (size), get (the published round; the last store operation), then decoding and ordering
    in Python.
    """
    first_op = [a.log[0][1] - t0 for a in agents]
    arrived = [next(e for e in a.log if e[0] == "add")[2] - t0 for a in agents]
    closed = [e[2] - t0 for a in agents for e in a.log if e[0] == "compare_set"]
    woke = [[e for e in a.log if e[0] == "wait"][-1][2] - t0 for a in agents]
    final = [a.log[-1] for a in agents]
    fetch = [end - start for _, start, end in final]
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
    for (impl, nodes), group in _grouped(results).items():
        round_cell = _round_cell(group, cap)
        totals = [sum(c.values()) for r in group for c in r.ops]
        node_cpu = [ms for r in group for ms in r.node_cpu_ms]
        ran = [r for r in group if r.procs]
        rows.append(
            [
                impl,
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
    capped = [r for r in group if r.round_s is None]
    if capped and not capped[0].procs:
        return f"> {cap:.0f} (cap; not run)"
    if capped:
        return f"> {cap:.0f} (cap; {len(capped[0].node_cpu_ms)}/{capped[0].nodes} had a Round)"
    done = [r.round_s for r in group if r.round_s is not None]
    return f"{statistics.median(done):.2f} ({min(done):.2f}-{max(done):.2f})"


def op_rows(results: Sequence[Result]) -> list[list[str]]:
    rows = []
    for (impl, nodes), group in _grouped(results).items():
        counters = [c for r in group for c in r.ops]
        cells = []
        for op in OPS:
            values = [c[op] for c in counters]
            if any(values):
                cells.append(f"{op} {statistics.mean(values):.2f}/{max(values)}")
        rows.append([impl, str(nodes), ", ".join(cells) or "-"])
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
    return [["phase", *(f"{impl} N={n}" for impl, n in groups)], *rows]


def _grouped(results: Sequence[Result]) -> dict[tuple[str, int], list[Result]]:
    groups: dict[tuple[str, int], list[Result]] = {}
    for result in results:
        groups.setdefault((result.impl, result.nodes), []).append(result)
    return groups


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def report(results: Sequence[Result], cap: float) -> str:
    header = [
        "impl",
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
    ops = markdown(["impl", "N", "op mean/max per node"], op_rows(results))
    text += f"\n\nStore operations per node in one join (mean/max):\n\n{ops}\n"
    phases = phase_rows(results)
    if phases:
        text += "\nBarrier round phases, seconds after the common start (median of runs):\n\n"
        text += markdown(phases[0], phases[1:]) + "\n"
    return text


# ---- main ------------------------------------------------------------------------------------


def raise_fd_limit(agents: int) -> None:
    """An agent is one client socket here and one on the server side; plus slack."""
    need = 4 * agents + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise BenchError(f"{agents} agents need {need} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def run_impl(impl: RendezvousImpl, args: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    for nodes in args.nodes:
        if any(r.round_s is None for r in results):
            print(f"{impl.value} N={nodes}: skipped (a smaller N already ran past the cap)")
            results.append(Result(impl.value, nodes, 0, 0.0, None, 0.0, [], [], {}))
            continue
        for repeat in range(args.repeats):
            result = run_round(impl, nodes, repeat, args)
            results.append(result)
            print(
                f"{impl.value} N={nodes} run {repeat}: {result.procs} process(es), connect "
                f"{result.connect_s:.2f} s, round {fmt_s(result.round_s)} s, store server CPU "
                f"{result.server_cpu_s:.2f} s",
                flush=True,
            )
            if result.round_s is None:
                break
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", default="64,256,1024", help="comma-separated N")
    parser.add_argument("--impl", default="barrier,dynamic", help="barrier, dynamic or both")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per N (median reported)")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds before '> cap'")
    parser.add_argument(
        "--threads-per-proc", type=int, default=128, help="agents per child process"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=0.05,
        help="sys.setswitchinterval in the agent processes (Python's default: 0.005)",
    )
    args = parser.parse_args(argv)
    try:
        args.nodes = [int(n) for n in args.nodes.split(",")]
        args.impl = [RendezvousImpl(name) for name in args.impl.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.nodes) < 1 or args.threads_per_proc < 1 or args.repeats < 1 or args.cap <= 0:
        parser.error("--nodes, --threads-per-proc, --repeats and --cap must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    try:
        raise_fd_limit(max(args.nodes))
        results = [r for impl in args.impl for r in run_impl(impl, args)]
    except BenchError as exc:
        print(f"rendezvous_scale: FAILED: {exc}", file=sys.stderr)
        return 1
    print()
    print(report(results, args.cap))
    print(
        f"machine: {os.cpu_count()} cores; 1-min load average {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end"
    )
    report_target(results)
    return 0


def report_target(results: Sequence[Result]) -> None:
    big = [r.round_s for r in results if r.impl == "barrier" and r.nodes == 1024]
    if not big:
        return
    if any(s is None for s in big):
        print(f"barrier, 1024 nodes: ran past the cap; MISSES the {TARGET_1024_S:.0f} s target")
        return
    median = statistics.median(s for s in big if s is not None)
    verdict = "meets" if median <= TARGET_1024_S else "MISSES"
    print(f"barrier, 1024 nodes: {median:.2f} s {verdict} the {TARGET_1024_S:.0f} s target")


if __name__ == "__main__":
    sys.exit(main())
