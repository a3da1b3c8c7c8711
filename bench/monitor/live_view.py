"""What the live view costs: a metrics scrape on an agent, the status page at 1,024 nodes, and
the step time of a plain training script with both on.

Three parts, each printed as markdown tables (`--parts` picks some):

1. `scrape`: one agent of 8 ranks. Its `NodeMetrics` is fed a realistic history (3 cycles of
   the records the agent writes: rendezvous_done, workers_started, stepping, checkpoints held
   and replicated, a health finding and a failure, restarts, straggler reports of the 32 worst
   ranks) and a progress snapshot of 8 ranks with their timeouts. Timed: `generate_latest` in
   process, beside the same series pre-built (the library's formatting alone) and an empty
   registry; and real HTTP scrapes (urllib, a new connection each, as a scraper makes) of
   `prometheus_client.start_http_server` in a child process, whose own CPU time per scrape
   gives the CPU share at Prometheus' usual 15 s interval and at 1 s, beside the same server
   on an empty registry. The variants are interleaved in rounds; ratios round by round.
2. `page`: 1,024 nodes x 8 ranks on a real TCPStore (127.0.0.1, libuv, its server in this
   process, as ftrun's rendezvous makes it): every node's `FeedWriter` writes the same kind of
   history (48 events a node in the store, 14 to 17 a cycle) and its live record; then the
   page's own calls are timed: the first `FeedReader.read()` (while another process, standing
   for another agent, reads the store every 10 ms), an incremental one (8 new events),
   `job_status` on the result (the report over every event) and its JSON. Floors: the same
   keys fetched in requests of 1,000 and parsed; a read with nothing new. And the store load
   the live records add (`FeedWriter.live()` against a bare set and get).
3. `steps`: a plain DDP script (gloo, CPU; this file's `--worker` mode: an MLP, a
   RankMonitorClient section and heartbeat per step, no tuning) under `ft_launcher` on 1 node x
   2 ranks, without and with `--ft-metrics-port=0 --ft-status-port=0`, a thread scraping
   /metrics and /status.json every 1 s in the runs with; interleaved pairs (off, on, ...).

Usage: .venv/bin/python -m bench.monitor.live_view [--parts scrape page steps] [--nodes 1024]
[--pairs 6] [--steps 1000] [--profile] [--smoke]
(`--profile`: cProfile of the page's two big calls)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.common import ROOT, smoke
from bench.common.report import (
    Stats,
    load_average,
    machine_line,
    pair_ratios,
    progress,
    ratio_cell,
    table,
)
from bench.common.timing import Stopwatch, p99, per_call_us

MODULE = "bench.monitor.live_view"  # run as `python -m` (its child and its workers too)
RANKS = 8
CYCLES = 3
CYCLE_S = 1200.0
WORST = 32
PREFIX = "ftrun/bench-live-view"
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
}
"""What a Prometheus server sends with a scrape (OpenMetrics preferred, gzip)."""
SLOW_STATUS_S = 0.5
"""A status build above this does not fit the page's 1 s cache comfortably."""


# ---- a realistic node history -----------------------------------------------------------------


def node_name(index: int) -> str:
    return f"dgx-{index:04d}-{40000 + index}"


def history(
    index: int, names: Sequence[str], start: float, failing: Sequence[int]
) -> list[dict[str, Any]]:
    """The records node `index` writes (as `EventLog` does) over CYCLES cycles starting at
    wall time `start`; the last cycle is still training. `failing[c]`: the node whose GPU
    fails in cycle c (an Xid, a health finding, then the failure), for every cycle but the
    last. Node 0 is the straggler detector's reporting node."""
    node, world = names[index], len(names) * RANKS
    ranks = list(range(index * RANKS, (index + 1) * RANKS))
    skew = (index % 97) * 0.003  # nodes do not write at the same instant
    offset = start - 5000.0 - index  # this node's monotonic clock
    out: list[dict[str, Any]] = []
    cycle = 0

    def emit(event: str, at: float, **fields: Any) -> None:
        ts = round(at + skew, 6)
        out.append({"event": event, "ts": ts, "mono": round(ts - offset, 6), "node": node,
                    "cycle": cycle, **fields})  # fmt: skip

    iteration = 0
    for cycle in range(CYCLES):
        t0 = start + cycle * CYCLE_S
        pids = [100000 + 1000 * cycle + index % 900 + r for r in range(RANKS)]
        emit("health_check", t0, duration=0.82, gpus=RANKS, ib_ports=RANKS)
        emit("rendezvous_done", t0 + 3.1, duration=2.27, group_rank=index, nodes=list(names),
             world_size=world, store_host=index == 0, standby=[], stalled_cycles=0)  # fmt: skip
        emit("workers_started", t0 + 3.6, ranks=ranks, pids=pids, path="forked")
        for rank, pid in zip(ranks, pids, strict=True):
            emit("rank_startup", t0 + 3.7, rank=rank, pid=pid, path="forked", to_script=0.31,
                 to_cuda=1.2, to_pg=2.4, to_first_step=8.9)  # fmt: skip
        emit("stepping", t0 + 12.6, ranks=ranks, progress_ts=round(t0 + 12.5, 6),
             progress_mono=round(t0 + 12.5 - offset, 6), iterations=[iteration + 1] * RANKS,
             startup=8.9)  # fmt: skip
        for k, at in enumerate((300.0, 600.0)):
            held = iteration + 500 * (k + 1)
            emit("ckpt_held", t0 + at, session="train", iteration=held, world_size=world,
                 stall=0.42)  # fmt: skip
        for rank in ranks:
            emit("ckpt_replicated", t0 + 602.1, session="train", iteration=held, rank=rank,
                 to=[names[(index + 1) % len(names)]], bytes=1_610_612_736, seconds=1.84,
                 lag=2.1)  # fmt: skip
        if index == 0:
            for seq, at in enumerate((400.0, 1000.0), start=1):
                worst = [[r * 131 % world, names[r * 131 % world // RANKS], 0.71 + 0.008 * r]
                         for r in range(WORST)]  # fmt: skip
                emit("straggler_report", t0 + at, seq=seq, ranks=world, worst=worst,
                     median=0.97)  # fmt: skip
        if cycle == CYCLES - 1:
            break  # still training
        end = t0 + CYCLE_S - 10.0
        if failing[cycle] == index:
            emit("health_finding", end - 0.4, finding="Xid 79", reading="GPU has fallen off "
                 "the bus", fault=True, gpu=3)  # fmt: skip
            emit(
                "failure",
                end + 0.3,
                kind="health",
                detail="Xid 79",
                key="health: Xid 79",
                message="GPU has fallen off the bus",
                decision="restart",
                rank=ranks[3],
            )
        iteration += 1180
        emit("health_watch", end + 0.5, polls=5800, mean_us=21.3, max_us=88.0)
        emit("last_progress", end + 0.5, before="stop", ranks=ranks,
             progress_ts=round(end - 0.6, 6), progress_mono=round(end - 0.6 - offset, 6),
             iterations=[iteration] * RANKS)  # fmt: skip
        emit("stop_done", end + 1.7, duration=1.2, killed=0, survivors=0)
        emit("restart", end + 1.8)
    return out


def snapshot(ranks: Sequence[int], iteration: int) -> list[Any]:
    """The rank monitor's progress snapshot of `ranks`, all stepping, timeouts calculated."""
    from ftrun.rank_monitor.protocol import Timeouts
    from ftrun.rank_monitor.records import ProgressSnapshot

    now = time.monotonic()
    sections: dict[str, float | None] = {"step": 12.5, "checkpoint": 180.0}
    timeouts = Timeouts(initial_heartbeat=600.0, heartbeat=45.0, sections=sections)
    return [
        ProgressSnapshot(
            rank=rank,
            pid=100000 + rank,
            worker_pid=100000 + rank,
            first_progress=now - 590.0,
            last_progress=now - 0.2 - 0.01 * rank,
            first_iteration=iteration - 1180,
            last_iteration=iteration,
            timeouts=timeouts,
        )
        for rank in ranks
    ]


def agent_registry(empty: bool, page: bool = False) -> Any:
    """A registry as the agent builds it (node 0: a failure, findings, straggler reports), or an
    empty one; `page`: the agent that serves the status page (its job series too)."""
    from prometheus_client import CollectorRegistry

    from ftrun.observe.metrics import NodeMetrics

    registry = CollectorRegistry(auto_describe=False)
    if empty:
        return registry
    names = [node_name(i) for i in range(4)]
    records = history(0, names, time.time() - CYCLES * CYCLE_S + 600, failing=[0, 2])
    ranks, iteration = list(range(RANKS)), 2 * 1180 + 700
    status = {"ettr": 0.93, "lost_s": 250.0, "wall_s": 3000.0, "cycle": 2, "restarts": 2}
    metrics = NodeMetrics("bench-job", names[0], lambda: snapshot(ranks, iteration),
                          (lambda: status) if page else lambda: None)  # fmt: skip
    for record in records:
        metrics.apply(record)
    registry.register(metrics)
    return registry


# ---- 1. scrape ----------------------------------------------------------------------------------


def serve_metrics(kind: str) -> int:
    """Child mode: serve a registry as the agent does; print the port; answer each line read
    on stdin with this process's CPU seconds so far; exit at EOF."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(0, "127.0.0.1", agent_registry(kind == "empty"))
    print(server.server_address[1], flush=True)
    for _ in sys.stdin:
        print(f"{time.process_time():.9f}", flush=True)
    server.shutdown()
    return 0


class MetricsChild:
    """A child process serving one registry over HTTP (`--serve-metrics`)."""

    def __init__(self, kind: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--serve-metrics", kind], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}/metrics"

    def cpu(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def get(url: str, headers: dict[str, str] | None = None) -> bytes:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read()


def scrape_part(args: argparse.Namespace) -> None:
    from prometheus_client import generate_latest

    agent, page = agent_registry(False), agent_registry(False, page=True)
    empty, frozen = agent_registry(True), agent_registry(True)
    frozen.register(Frozen(list(agent.collect())))
    text = generate_latest(agent).decode()
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    page_series = [ln for ln in generate_latest(page).decode().splitlines() if ln[:1] != "#"]
    inproc = {
        "agent, 8 ranks": lambda: generate_latest(agent),
        "the page's agent (+ job series)": lambda: generate_latest(page),
        FROZEN: lambda: generate_latest(frozen),
        "floor: an empty registry": lambda: generate_latest(empty),
    }
    samples: dict[str, list[float]] = {name: [] for name in inproc}
    rounds: dict[str, list[float]] = {name: [] for name in inproc}
    for round_ in range(args.rounds):
        names = list(inproc)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            costs = per_call_us(inproc[name], args.calls)
            samples[name] += costs
            rounds[name].append(statistics.median(costs))
    progress(f"scrape: in process done ({args.rounds} rounds x {args.calls} calls)")

    children = {"agent": MetricsChild("agent"), "empty": MetricsChild("empty")}
    try:
        http = {
            "agent, plain GET (text format)": (children["agent"], None),
            "agent, as Prometheus asks (OpenMetrics, gzip)": (
                children["agent"],
                PROMETHEUS_HEADERS,
            ),
            "floor: empty registry, same server": (children["empty"], None),
        }
        wire = {name: len(get(c.url, h)) for name, (c, h) in http.items()}
        hsamples: dict[str, list[float]] = {name: [] for name in http}
        hrounds: dict[str, list[float]] = {name: [] for name in http}
        cpu: dict[str, list[float]] = {name: [] for name in http}
        for round_ in range(args.rounds):
            names = list(http)
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                child, headers = http[name]
                before = child.cpu()
                costs = per_call_us(lambda c=child, h=headers: get(c.url, h), args.http_calls)
                cpu[name].append((child.cpu() - before) / args.http_calls * 1e6)
                hsamples[name] += costs
                hrounds[name].append(statistics.median(costs))
        progress(f"scrape: HTTP done ({args.rounds} rounds x {args.http_calls} scrapes)")
    finally:
        for child in children.values():
            child.close()

    print(f"\n### Metrics scrape on one agent ({RANKS} ranks, {CYCLES} cycles of events)\n")
    print(f"{len(series)} series on an agent ({len(text)} bytes of text format); "
          f"{len(page_series)} on the agent serving the page.\n")  # fmt: skip
    rows = [
        [name, f"{statistics.median(samples[name]):.1f}", f"{p99(samples[name]):.1f}",
         "-" if name.startswith("floor") else ratio_cell(_ratios(rounds[name], rounds[FROZEN]))]
        for name in inproc
    ]  # fmt: skip
    print(table(["generate_latest(registry), in process", "median (us)", "p99 (us)",
                 "/ the same series pre-built, round by round"], rows, markdown=True))  # fmt: skip
    print()
    hfloor = "floor: empty registry, same server"
    rows = []
    for name in http:
        per_scrape = statistics.median(cpu[name])
        rows.append([
            name, str(wire[name]), f"{statistics.median(hsamples[name]):.0f}",
            f"{p99(hsamples[name]):.0f}",
            "-" if name == hfloor else ratio_cell(_ratios(hrounds[name], hrounds[hfloor])),
            f"{per_scrape:.0f}", f"{per_scrape / 1e6 / 15 * 100:.4f}",
            f"{per_scrape / 1e6 * 100:.3f}",
        ])  # fmt: skip
    print(table(["HTTP scrape of start_http_server (urllib, 127.0.0.1)", "bytes", "median (us)",
                 "p99 (us)", "/ floor", "server CPU per scrape (us)",
                 "CPU share, every 15 s (% of a core)", "every 1 s (%)"], rows,
                markdown=True))  # fmt: skip
    print(f"\nmedians over {args.rounds} rounds x {args.calls} calls (in process) and x "
          f"{args.http_calls} scrapes (HTTP), the variants interleaved round by round; "
          "server CPU: the serving child's own CPU time per scrape, median of the "
          "rounds.")  # fmt: skip


FROZEN = "floor: the same series pre-built (the formatting alone)"


class Frozen:
    """A collector that yields families built once: what generate_latest costs without the
    agent's collect()."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> Any:
        return iter(self._families)


def _ratios(ours: Sequence[float], floor: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(ours, floor, strict=True) if b > 0]


# ---- 2. the status page at scale ---------------------------------------------------------------


@dataclasses.dataclass
class Feed:
    """The simulated job in its store: every node's writer, and what they wrote."""

    store: Any
    names: list[str]
    writers: list[Any]
    in_store: int
    kept_local: int
    fill_s: float


def fill_store(nodes: int) -> Feed:
    """A real TCPStore on 127.0.0.1 (its server in this process), every node's history in it."""
    from torch.distributed import TCPStore

    from ftrun.observe.feed import KEPT_LOCAL, FeedWriter

    names = [node_name(i) for i in range(nodes)]
    start = time.time() - (CYCLES - 1) * CYCLE_S - 700.0
    failing = [17 % nodes, 503 % nodes]
    # as ftrun's rendezvous makes it (ftrun.store.connect): the libuv server
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    writers = [FeedWriter(store, PREFIX, name) for name in names]
    began, written, kept_local = Stopwatch(), 0, 0
    for index, writer in enumerate(writers):
        writer.register()
        records = history(index, names, start, failing)
        writer.events(records)
        written += len(records)
        kept_local += sum(1 for r in records if r["event"] in KEPT_LOCAL)
        writer.live(live_record(index, time.time()))
    fill_s = began.seconds()
    feed = Feed(store, names, writers, written - kept_local, kept_local, fill_s)
    progress(f"page: {nodes} nodes wrote {feed.in_store} events to the store in {fill_s:.1f} s")
    return feed


PROBE = textwrap.dedent(
    """
    import sys, threading
    from torch.distributed import TCPStore
    from bench.common.timing import Stopwatch
    store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, use_libuv=True)
    store.get(sys.argv[2])
    print("ready", flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    worst = 0.0
    while not done.wait(0.01):
        began = Stopwatch()
        store.get(sys.argv[2])
        worst = max(worst, began.seconds())
    print(worst, flush=True)
    """
)
"""Another agent: a process of its own that reads one key of the store every 10 ms and says
how long its slowest read waited."""


class StoreProbe:
    def __init__(self, port: int, key: str) -> None:
        argv = [sys.executable, "-c", PROBE, str(port), key]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(argv, stdin=pipe, stdout=pipe, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()
        time.sleep(0.1)

    def worst(self) -> float:
        """Stop; the probe's slowest read, seconds."""
        out, _ = self.proc.communicate(timeout=30)
        return float(out)


def first_reads(feed: Feed, repeats: int) -> dict[str, Any]:
    """A fresh reader's first read, `repeats` times, another agent's store reads meanwhile,
    and the floors: the same keys fetched in one request (as the reader asks) and in requests
    of BATCH keys, and those plus parsing every line."""
    from ftrun.eventlog.reader import parse_line
    from ftrun.observe.feed import FeedReader

    store = feed.store
    keys = [f"{PREFIX}/observe/events/{n}/{i}" for n in feed.names
            for i in range(1, int(store.get(f"{PREFIX}/observe/events/{n}/n")) + 1)]  # fmt: skip
    found: dict[str, Any] = {name: [] for name in ("first", "blocked", "one", "batched", "parsed")}
    for repeat in range(repeats):
        found["reader"] = found["events"] = found["live"] = None  # the last reader's memory
        reader = FeedReader(store, PREFIX)
        probe = StoreProbe(store.port, f"{PREFIX}/observe/live/{feed.names[-1]}")
        rss = psutil.Process().memory_info().rss
        began = Stopwatch()
        found["events"], found["live"] = reader.read()
        found["first"].append(began.seconds())
        if repeat == 0:
            found["rss"] = psutil.Process().memory_info().rss - rss
        found["blocked"].append(probe.worst())
        found["reader"] = reader
        progress(f"page: a first read took {found['first'][-1]:.1f} s")
        began = Stopwatch()
        store.multi_get(keys)
        found["one"].append(began.seconds())
        began = Stopwatch()
        raw = [v for i in range(0, len(keys), BATCH) for v in store.multi_get(keys[i : i + BATCH])]
        found["batched"].append(began.seconds())
        for line in raw:
            parse_line(line.decode(errors="replace"))
        found["parsed"].append(began.seconds())
        found["bytes"] = sum(len(line) for line in raw)
        del raw
    assert sum(map(len, found["events"].values())) == feed.in_store, "the reader missed events"
    return found


BATCH = 1000


def incremental_reads(feed: Feed, reader: Any, calls: int) -> tuple[list[float], list[float]]:
    """(8 nodes wrote one event and a live record each, nothing new): seconds per read."""
    nodes, changed, idle = len(feed.names), [], []
    for rep in range(calls):
        began = Stopwatch()
        reader.read()
        idle.append(began.seconds())
        for k in range(8):  # 8 nodes hold a newer checkpoint; their live records move on
            index = (rep * 8 + k) * 37 % nodes
            record = {"event": "ckpt_held", "ts": round(time.time(), 6), "mono": 6000.0 + rep,
                      "node": feed.names[index], "cycle": CYCLES - 1, "session": "train",
                      "iteration": 5000 + rep, "world_size": nodes * RANKS}  # fmt: skip
            feed.writers[index].events([record])
            feed.writers[index].live(live_record(index, time.time()))
        began = Stopwatch()
        reader.read()
        changed.append(began.seconds())
    progress("page: incremental reads done")
    return changed, idle


def status_builds(reader: Any, repeats: int) -> tuple[list[float], list[float], bytes]:
    """job_status on the reader's events and its JSON: seconds each, and the JSON."""
    from ftrun.eventlog.job_status import job_status

    events, live = reader.events, reader.read()[1]
    builds, dumps, data = [], [], b""
    for _ in range(repeats):
        began = Stopwatch()
        status = job_status("bench-job", events, live, time.time())
        builds.append(began.seconds())
        began = Stopwatch()
        data = json.dumps(status, default=str).encode()
        dumps.append(began.seconds())
    progress("page: status builds done")
    return builds, dumps, data


def live_sets(feed: Feed, rounds: int, calls: int) -> tuple[dict[str, list[float]], int]:
    """Microseconds per live record written, with the store's own set and get as floors."""
    record = json.dumps(live_record(0, time.time())).encode()
    key, writer, store = f"{PREFIX}/observe/live/{feed.names[0]}", feed.writers[0], feed.store
    calls_by_name = {
        LIVE: lambda: writer.live(live_record(0, time.time())),
        "floor: store.set of the same bytes": lambda: store.set(key, record),
        "floor: store.get of them (a round trip)": lambda: store.get(key),
    }
    return _interleaved_us(calls_by_name, rounds, calls), len(record)


LIVE = "FeedWriter.live(): json.dumps + store.set"


def page_part(args: argparse.Namespace) -> None:
    from ftrun.observe.page import CachedStatus

    feed = fill_store(args.nodes)
    reads = first_reads(feed, args.repeats)
    reader = reads["reader"]
    changed, idle = incremental_reads(feed, reader, args.page_calls)
    builds, dumps, data = status_builds(reader, args.repeats)
    sets, record_bytes = live_sets(feed, args.rounds, args.calls)

    nodes = args.nodes
    print(f"\n### The status page at {nodes:,} nodes x {RANKS} ranks (a TCPStore on 127.0.0.1)\n")
    print(f"{feed.in_store:,} events in the store ({reads['bytes'] / 2**20:.1f} MiB; "
          f"{feed.kept_local:,} more kept in the nodes' files only), written by {nodes:,} "
          f"FeedWriters in {feed.fill_s:.1f} s; the reader holds them in "
          f"{reads['rss'] / 2**20:.0f} MiB (its process's RSS growth over the first read); the "
          f"status JSON is {len(data):,} bytes ({len(data) / 2**20:.2f} MiB).\n")  # fmt: skip
    rows = [
        ["FeedReader.read(), the first (every event)", Stats.of(reads["first"]), "{:.0f}"],
        ["  meanwhile, another agent's slowest store.get", Stats.of(reads["blocked"]), "{:.0f}"],
        [
            "  store.multi_get of the same keys, one request (read() asks in requests of 1,000)",
            Stats.of(reads["one"]),
            "{:.0f}",
        ],
        [f"  floor: the same keys in requests of {BATCH:,}", Stats.of(reads["batched"]), "{:.0f}"],
        ["  floor: those + parse_line of every line", Stats.of(reads["parsed"]), "{:.0f}"],
        ["FeedReader.read(), 8 new events, 8 new live records", Stats.of(changed), "{:.2f}"],
        ["  floor: FeedReader.read(), nothing new (its 3 requests)", Stats.of(idle), "{:.2f}"],
        ["job_status(...) on every event (build_report inside)", Stats.of(builds), "{:.0f}"],
        ["json.dumps(status) (what /status.json sends)", Stats.of(dumps), "{:.1f}"],
    ]
    print(table(["the page's call", "ms, median (min-max)"],
                [[name, _ms(s, fmt)] for name, s, fmt in rows], markdown=True))  # fmt: skip
    refresh = statistics.median(changed) + statistics.median(builds) + statistics.median(dumps)
    kept = max(1.0, CachedStatus.SHARE * refresh)  # how long the page's cache keeps a document
    print(f"\nmedian (min-max) of {args.repeats} runs (first reads: a fresh reader each; the "
          f"status: the same events), of {args.page_calls} for the incremental reads. One "
          f"refresh (an incremental read + job_status + the JSON) takes {refresh * 1e3:.0f} ms; "
          f"the page's cache keeps a document for max(1 s, {CachedStatus.SHARE:g} x its build) = "
          f"{kept:.1f} s, so however often browsers poll, the page's agent spends at most "
          f"{refresh / kept * 100:.0f} % of a core on it "
          f"({refresh / max(2.0, kept) * 100:.0f} % with one browser polling every 2 s, the "
          "page's own interval).")  # fmt: skip
    if statistics.median(builds) > SLOW_STATUS_S:
        print(f"\n**job_status takes {statistics.median(builds):.2f} s at {nodes:,} nodes: the "
              f"page refreshes every {kept:.1f} s, not every second.**")  # fmt: skip
    print()
    rows = [[name, f"{statistics.median(v):.1f}", f"{p99(v):.1f}"] for name, v in sets.items()]
    print(table(["store load of the live records", "us per call, median", "p99"], rows,
                markdown=True))  # fmt: skip
    rate, live_us = nodes / 2.0, statistics.median(sets[LIVE])
    print(f"\nAt {nodes:,} nodes, one live record per node every 2 s is {rate:.0f} sets/s on the "
          f"store ({record_bytes} bytes each, {rate * record_bytes / 1024:.0f} KiB/s), plus "
          f"each event as it happens; a writer spends {live_us:.0f} us per record "
          f"({live_us / 2e6 * 100:.4f} % of a core). A store.set has no reply: the writer "
          "never waits on the store.")  # fmt: skip
    if args.profile:
        profile_status(reader, nodes)
        profile_first_read(feed)


def profile_status(reader: Any, nodes: int) -> None:
    from ftrun.eventlog.job_status import job_status

    events, live = reader.events, reader.read()[1]
    print_profile(lambda: job_status("bench-job", events, live, time.time()),
                  f"job_status at {nodes:,} nodes")  # fmt: skip


def profile_first_read(feed: Feed) -> None:
    from ftrun.observe.feed import FeedReader

    print_profile(lambda: FeedReader(feed.store, PREFIX).read(), "the first FeedReader.read()")


def live_record(index: int, now: float) -> dict[str, Any]:
    ranks = range(index * RANKS, (index + 1) * RANKS)
    return {"ts": now, "cycle": 2, "progress": [[r, 3060, round(0.2 + 0.01 * (r % RANKS), 3)]
                                                for r in ranks]}  # fmt: skip


def _interleaved_us(
    calls: dict[str, Callable[[], Any]], rounds: int, count: int
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            samples[name] += per_call_us(calls[name], count)
    return samples


def _ms(stats: Stats | None, fmt: str) -> str:
    if stats is None:
        return "-"
    scaled = Stats(stats.median * 1e3, stats.low * 1e3, stats.high * 1e3, stats.n)
    return scaled.cell(fmt)


def print_profile(call: Callable[[], Any], what: str) -> None:
    profile = cProfile.Profile()
    profile.enable()
    call()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(15)
    lines = text.getvalue().strip().splitlines()
    start = next((i for i, line in enumerate(lines) if "function calls" in line), 0)
    print(f"\ncProfile of {what}, top 15 by cumulative time:\n\n```")
    print("\n".join(line.rstrip() for line in lines[start:]))
    print("```")


# ---- 3. step time under ft_launcher -----------------------------------------------------------


def worker(argv: list[str]) -> int:
    """A plain DDP training script, as a user writes one (run by ft_launcher)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ftrun.client_lib import RankMonitorClient

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    width = args.width
    layers = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                           nn.ReLU(), nn.Linear(width, width)).to(device)  # fmt: skip
    model = DDP(layers, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    client = RankMonitorClient()
    client.init_workload_monitoring()
    data = torch.randn(args.batch, width, device=device)
    target = torch.randn(args.batch, width, device=device)
    times = []
    for step in range(1, args.steps + 1):
        began = Stopwatch()
        client.start_section("step")
        loss = nn.functional.mse_loss(model(data), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()  # the value a user logs: on a GPU, the step's end
        client.end_section("step", iteration=step)
        client.send_heartbeat(iteration=step)
        times.append(began.seconds())
    if rank == 0:
        kept = times[WARM_STEPS:]
        print(f"mean step time: {statistics.fmean(kept) * 1e3:.2f} ms", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "steps.json").write_text(json.dumps(kept))
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


WARM_STEPS = 20
RUN_TIMEOUT_S = 300.0
URL = re.compile(r"(metrics|status page): (http://\S+)")


class Scraper(threading.Thread):
    """Every second: GET /metrics and /status.json of the job, once their URLs are logged."""

    def __init__(self, log: Path) -> None:
        super().__init__(name="scraper", daemon=True)
        self._log, self.stop = log, threading.Event()
        self.ok, self.failed = {"metrics": 0, "status": 0}, 0

    def run(self) -> None:
        urls: dict[str, str] = {}
        while not self.stop.wait(0.05) and len(urls) < 2:
            text = self._log.read_text(errors="replace") if self._log.exists() else ""
            for kind, url in URL.findall(text):
                urls["metrics" if kind == "metrics" else "status"] = url
        if "status" in urls:
            urls["status"] = urls["status"].rstrip("/") + "/status.json"
        while not self.stop.is_set():
            for kind, url in urls.items():
                try:
                    get(url, PROMETHEUS_HEADERS if kind == "metrics" else None)
                    self.ok[kind] += 1
                except OSError as exc:
                    closed = (ConnectionRefusedError, ConnectionResetError)
                    if self.ok[kind] and isinstance(getattr(exc, "reason", exc), closed):
                        return  # the job is ending: its servers closed
                    self.failed += 1
                    progress(f"scrape of {url} failed: {exc!r}")
            self.stop.wait(1.0)


def run_once(on: bool, args: argparse.Namespace) -> tuple[list[float], dict[str, int]]:
    """Rank 0's step times of one run, and what the scraper got (metrics, status, failed)."""
    from bench.common.jobs import FT, SECTION_ARGS, job

    extra = ["--nnodes=1", *SECTION_ARGS, f"--nproc-per-node={args.nproc}"]
    if on:
        extra += ["--ft-metrics-port=0", "--ft-status-port=0"]
    worker_args = ["--worker", "--steps", str(args.steps), "--width", str(args.width),
                   "--device", args.device]  # fmt: skip
    with job(FT, extra, worker_args, MODULE, launchers=1) as started:
        scraper = Scraper(started.tmp / "launcher0.log") if on else None
        if scraper is not None:
            scraper.start()
        try:
            done = started.wait(lambda: None if started.running() else True, RUN_TIMEOUT_S)
        finally:
            if scraper is not None:
                scraper.stop.set()
                scraper.join(timeout=15)
        codes = started.exit_codes()
        if done is None or codes != [0]:
            raise SystemExit(f"run ({'on' if on else 'off'}) failed: {started.describe()}")
        if scraper is not None and (scraper.ok["metrics"] == 0 or scraper.ok["status"] == 0):
            raise SystemExit(f"run (on): nothing scraped ({scraper.ok}, {scraper.failed} failed)")
        scraped = {**scraper.ok, "failed": scraper.failed} if scraper is not None else {}
        return json.loads((started.out / "steps.json").read_text()), scraped


def steps_part(args: argparse.Namespace) -> None:
    from bench.common.jobs import take_charge

    take_charge()
    means: dict[str, dict[int, float | None]] = {"off": {}, "on": {}}
    medians: dict[str, dict[int, float | None]] = {"off": {}, "on": {}}
    scraped = {"metrics": 0, "status": 0, "failed": 0}
    for pair in range(args.pairs):
        for variant in ("off", "on"):
            times, got = run_once(variant == "on", args)
            means[variant][pair] = statistics.fmean(times)
            medians[variant][pair] = statistics.median(times)
            for name, count in got.items():
                scraped[name] += count
            progress(f"steps: pair {pair + 1}/{args.pairs} {variant}: "
                     f"mean {statistics.fmean(times) * 1e3:.2f} ms")  # fmt: skip
    backend = "NCCL, one GPU per rank" if args.device == "cuda" else "gloo, CPU"
    print(f"\n### Step time under ft_launcher, 1 node x {args.nproc} rank(s) ({backend}), "
          "live view off / on\n")  # fmt: skip
    rows = []
    for label, per_run in (("mean step (ms)", means), ("median step (ms)", medians)):
        off, on = Stats.of(list(per_run["off"].values())), Stats.of(list(per_run["on"].values()))
        ratios = pair_ratios(per_run["on"], per_run["off"])
        rows.append([label, _ms(off, "{:.2f}"), _ms(on, "{:.2f}"), ratio_cell(ratios)])
    print(table(["per run", "off", "on: both ports, scraped every 1 s", "on/off, pair by pair"],
                rows, markdown=True))  # fmt: skip
    print(f"\nmedian (min-max) over {args.pairs} pairs, run off then on; each run "
          f"{args.steps - WARM_STEPS} steps timed (after {WARM_STEPS}) by rank 0 of this file's "
          f"`--worker` (a {args.width}-wide 3-layer MLP, batch 128, a step section and a "
          "heartbeat per step); in the runs with, /metrics (as Prometheus asks) and "
          f"/status.json are scraped every 1 s from this process ({scraped['metrics']} and "
          f"{scraped['status']} scrapes in all, {scraped['failed']} failed).")  # fmt: skip
    pairs = ", ".join(f"{(means['off'][p] or 0) * 1e3:.2f}/{(means['on'][p] or 0) * 1e3:.2f}"
                      for p in range(args.pairs))  # fmt: skip
    print(f"\nmean step per pair, off/on (ms): {pairs}")


# ---- main ---------------------------------------------------------------------------------------

PARTS: dict[str, Callable[[argparse.Namespace], None]] = {
    "scrape": scrape_part,
    "page": page_part,
    "steps": steps_part,
}


def main() -> int:
    if "--worker" in sys.argv[1:]:
        return worker(sys.argv[1:])
    if sys.argv[1:2] == ["--serve-metrics"]:
        return serve_metrics(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (scrape)")
    parser.add_argument("--calls", type=int, default=200, help="in-process calls per round")
    parser.add_argument("--http-calls", type=int, default=100, help="HTTP scrapes per round")
    parser.add_argument("--nodes", type=int, default=1024, help="simulated nodes (page)")
    parser.add_argument("--repeats", type=int, default=3, help="first reads and status builds")
    parser.add_argument("--page-calls", type=int, default=20, help="incremental reads")
    parser.add_argument("--profile", action="store_true", help="cProfile the page's build")
    parser.add_argument("--pairs", type=int, default=6, help="off/on pairs (steps)")
    parser.add_argument("--steps", type=int, default=1000, help="steps per run (steps)")
    parser.add_argument("--width", type=int, default=512, help="the worker's MLP width")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(steps)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (steps)")
    sizes = {"rounds": 2, "calls": 2, "http_calls": 2, "nodes": 8, "repeats": 1,
             "page_calls": 1, "pairs": 1, "steps": WARM_STEPS + 5, "width": 8, "nproc": 1}
    args = smoke.parse_args(parser, sizes)
    if args.steps <= WARM_STEPS:
        parser.error(f"--steps must be > {WARM_STEPS}")
    load = load_average()
    for name in args.parts:
        PARTS[name](args)
    print(f"\n{machine_line(load)}; torch {_torch_version()}")
    return 0


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
