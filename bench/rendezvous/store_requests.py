"""How often the agents ask the store while training: TCPStore beside etcd.

    .venv/bin/python -m bench.rendezvous.store_requests [--runs 3] [--window 20] [--smoke]

A real job, as `common.jobs` starts one: 2 `ft_launcher`s x 2 ranks of
bench/workers/user_worker.py (gloo, a tiny DDP model, 0.05 s of "work" a step), every option at
its default (`--monitor-interval` 0.1 s included), on `--rdzv-backend=c10d` (the TCPStore served
by the agent on the endpoint host) and on `--rdzv-backend=etcd` (a real 3-member etcd cluster on
127.0.0.1, tests/etcd_cluster.py's, started by this bench; the first-listed member a follower;
each launcher asks first the member its pid picks). The runs alternate between the two stores.
Once every rank has logged `--warm` steps, the store traffic is counted over `--window` seconds
of steady training (no restart, every rank stepping to the end of it), then the job is killed.

Counted, nothing in the launcher changed:

- etcd: its own count of KV requests (`grpc_server_handled_total`, every member; exact, per
  method), divided by the 2 agents (the workers never talk to etcd);
- both: the kernel's count of data segments each agent process sent on its sockets to the
  store's port(s) (`ss -ti`: `data_segs_out`; the TCPStore's server side, inside the first
  agent, is not counted). TCPStore has no request counter; it sends one segment per request for
  `check`, `add`, `compare_set` and `wait` (a `get` is two requests on the wire: a wait, then
  the get), which the bench checks on a client of its own first ("calibration"), so the
  segments are its request count; for etcd the segments per request come out beside etcd's
  exact count;
- the CPU time of each agent process, and of the etcd members, over the window.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil

from bench.common import smoke
from bench.common.jobs import FT, USER_WORKER, Job, Launcher, job, take_charge
from bench.common.logs import read_steps
from bench.common.report import (
    Stats,
    load_average,
    machine_line,
    pair_ratios,
    progress,
    ratio_cell,
    table,
)
from bench.common.timing import Stopwatch
from bench.rendezvous.stores import (
    EtcdMissing,
    etcd_cluster,
    kv_requests,
    member_addresses,
    members_cpu_s,
    place_leader,
    requests_between,
)

BACKENDS = ("tcp", "etcd")
START_TIMEOUT_S = 120.0
MONITOR_INTERVAL_S = 0.1
"""ft_launcher's default `--monitor-interval` (the jobs here leave it so)."""
CALIBRATION_CALLS = 500


@dataclasses.dataclass
class Window:
    """One job's steady-training window, per agent (launcher index)."""

    backend: str
    run: int
    seconds: float
    segments: dict[int, int]
    """Data segments each agent sent to the store's port(s) in the window."""
    agent_cpu_s: dict[int, float]
    steps: int
    """Steps rank 0 finished in the window."""
    etcd_requests: dict[str, int] | None = None
    """etcd's own count, all agents together, by method."""
    etcd_cpu_s: float | None = None
    etcd_idle_cpu: float | None = None
    """The members' CPU share (of a core) before the job, with no client: Raft's heartbeats."""

    def segments_per_s(self) -> float:
        """Per agent, the median of the agents."""
        return statistics.median(self.segments.values()) / self.seconds

    def requests_per_s(self, segments_per_check: float) -> float:
        """Per agent: etcd's own count over the agents; TCPStore, which counts nothing: the
        agents' data segments over the segments one `check` sends (the calibration)."""
        if self.etcd_requests is None:
            return self.segments_per_s() / segments_per_check
        return sum(self.etcd_requests.values()) / len(self.segments) / self.seconds


# ---- the kernel's per-socket counts ---------------------------------------------------------


_SOCKET = re.compile(r"\S+:(?P<lport>\d+)\s+\S+:(?P<rport>\d+)\s+users:\((?P<users>.*)\)")


def segments_sent(pids: Sequence[int], ports: set[int]) -> dict[int, int]:
    """Data segments each of `pids` has sent so far on its established TCP sockets whose
    remote port is one of `ports` (`ss -tinp`: one line of addresses and owners, then one of
    tcp_info, per socket)."""
    text = subprocess.run(
        ["ss", "-tinpH", "state", "established"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    sent = dict.fromkeys(pids, 0)
    owner: int | None = None
    for line in text.splitlines():
        if not line[:1].isspace():  # a socket's first line
            found = _SOCKET.search(line)
            owner = None
            if found and int(found["rport"]) in ports:
                owner = next((p for p in pids if f"pid={p}," in found["users"]), None)
        elif owner is not None:
            segs = re.search(r"\bdata_segs_out:(\d+)", line)
            sent[owner] += int(segs[1]) if segs else 0
            owner = None
    return sent


def calibrate(etcd: Any) -> dict[str, dict[str, float]]:
    """Data segments per call of each kind the agents make, on a client of this process: how
    many requests a TCPStore segment count means, and what an etcd request sends."""
    import torch.distributed as dist

    from ftrun.store.etcd_store import EtcdStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tcp = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    stores: dict[str, tuple[Any, set[int]]] = {"tcp": (tcp, {server.port})}
    if etcd is not None:
        client = EtcdStore(
            member_addresses(etcd), "bench-calibration", datetime.timedelta(seconds=30)
        )
        stores["etcd"] = (client, {port for _, port in member_addresses(etcd)})
    found: dict[str, dict[str, float]] = {}
    for backend, (store, ports) in stores.items():
        store.set("k", "v")
        store.set("n", "0")
        calls: dict[str, Callable[[], Any]] = {
            "check": lambda s=store: s.check(["k"]),
            "get": lambda s=store: s.get("k"),
            "add": lambda s=store: s.add("n", 1),
            "set": lambda s=store: s.set("k", "v"),
        }
        found[backend] = {}
        for name, call in calls.items():
            before = segments_sent([os.getpid()], ports)[os.getpid()]
            for _ in range(CALIBRATION_CALLS):
                call()
            after = segments_sent([os.getpid()], ports)[os.getpid()]
            found[backend][name] = (after - before) / CALIBRATION_CALLS
    del tcp, server
    return found


# ---- one job --------------------------------------------------------------------------------


def launcher_for(backend: str, etcd: Any) -> Launcher:
    if backend == "tcp":
        return FT  # --rdzv-backend=c10d on the job's own port
    endpoints = ",".join(f"{h}:{p}" for h, p in member_addresses(etcd))
    args = ("--rdzv-backend=etcd", f"--rdzv-endpoint={endpoints}")  # the later flags win
    return dataclasses.replace(FT, name="ft_launcher on etcd", args=args)


def steps_of(started: Job) -> dict[int, int]:
    """The last step each rank logged (ranks 0..3)."""
    last = {}
    for rank in range(4):
        lines = [r for r in read_steps(started.out, rank) if not r.fault]
        last[rank] = lines[-1].step if lines else -1
    return last


def pids_of(started: Job) -> set[int]:
    return {r.pid for rank in range(4) for r in read_steps(started.out, rank)}


def measure(backend: str, run: int, args: argparse.Namespace) -> Window:
    """One job on `backend`; on etcd, a fresh cluster of its own (the job's clean-up kills
    every descendant of the bench, the members included)."""
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(etcd_cluster()) if backend == "etcd" else None
        idle = None
        if etcd is not None:
            place_leader(etcd, first_leads=False)
            cpu0, watch = members_cpu_s(etcd), Stopwatch()
            time.sleep(args.idle)
            idle = (members_cpu_s(etcd) - cpu0) / watch.seconds()
        window = _measure(backend, run, args, etcd)
        window.etcd_idle_cpu = idle
        return window


def _measure(backend: str, run: int, args: argparse.Namespace, etcd: Any) -> Window:
    worker_args = ["--client", "ftrun", "--steps", str(args.steps), "--ckpt-every", "0"]
    with job(launcher_for(backend, etcd), [], worker_args, USER_WORKER) as started:
        warm = started.wait(
            lambda: True if min(steps_of(started).values()) >= args.warm else None,
            START_TIMEOUT_S,
        )
        if warm is None:
            raise SystemExit(f"{backend} run {run}: no training: {started.describe()}")
        agents = [p.pid for p in started.procs]
        ports = {started.port} if backend == "tcp" else {p for _, p in member_addresses(etcd)}
        procs = [psutil.Process(pid) for pid in agents]
        pids0, steps0 = pids_of(started), steps_of(started)
        requests0 = kv_requests(etcd) if backend == "etcd" else None
        etcd_cpu0 = members_cpu_s(etcd) if backend == "etcd" else None
        cpu0 = [_cpu_s(p) for p in procs]
        segs0 = segments_sent(agents, ports)
        watch = Stopwatch()
        time.sleep(args.window)
        segs1 = segments_sent(agents, ports)
        seconds = watch.seconds()
        cpu1 = [_cpu_s(p) for p in procs]
        etcd_cpu = members_cpu_s(etcd) - etcd_cpu0 if etcd_cpu0 is not None else None
        requests = None
        if requests0 is not None:
            requests = requests_between(requests0, kv_requests(etcd))
        steps1 = steps_of(started)
        if not started.running() or pids_of(started) != pids0:
            raise SystemExit(f"{backend} run {run}: the job restarted or ended in the window: "
                             f"{started.describe()}")  # fmt: skip
        if min(steps1[r] - steps0[r] for r in steps0) < 1:
            raise SystemExit(f"{backend} run {run}: a rank stopped stepping in the window")
        return Window(
            backend=backend,
            run=run,
            seconds=seconds,
            segments={i: segs1[pid] - segs0[pid] for i, pid in enumerate(agents)},
            agent_cpu_s={i: c1 - c0 for i, (c0, c1) in enumerate(zip(cpu0, cpu1, strict=True))},
            steps=steps1[0] - steps0[0],
            etcd_requests=requests,
            etcd_cpu_s=etcd_cpu,
        )


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


# ---- report ---------------------------------------------------------------------------------


def report(windows: Sequence[Window], calibration: dict[str, dict[str, float]]) -> str:
    by_backend = {b: [w for w in windows if w.backend == b] for b in BACKENDS}
    per_check = calibration["tcp"]["check"]
    rows = []
    for backend, runs in by_backend.items():
        if not runs:
            continue
        segments = Stats.of([w.segments_per_s() for w in runs])
        requests = Stats.of([w.requests_per_s(per_check) for w in runs])
        cpu = Stats.of([statistics.median(w.agent_cpu_s.values()) / w.seconds * 100 for w in runs])
        store_cpu = Stats.of([(w.etcd_cpu_s or 0) / w.seconds * 100 for w in runs])
        idle = Stats.of([(w.etcd_idle_cpu or 0) * 100 for w in runs])
        methods = collections.Counter[str]()
        for w in runs:
            for method, count in (w.etcd_requests or {}).items():
                methods[method] += count
        agent_s = sum(w.seconds * len(w.segments) for w in runs)
        by_method = ", ".join(f"{m} {n / agent_s:.2f}" for m, n in sorted(methods.items()))
        etcd = backend == "etcd"
        rows.append(
            [
                "etcd, 3 members" if etcd else "TCPStore (c10d)",
                str(len(runs)),
                requests.cell() if requests else "-",
                "etcd's own count / 2 agents" if etcd else f"segments / {per_check:.2f} per check",
                by_method or "-",
                segments.cell() if segments else "-",
                cpu.cell("{:.1f}") if cpu else "-",
                store_cpu.cell("{:.1f}") if etcd and store_cpu else "-",
                idle.cell("{:.1f}") if etcd and idle else "-",
            ]
        )
    header = [
        "store",
        "runs",
        "requests/s per agent",
        "counted as",
        "etcd: by method, per agent per s",
        "data segments/s per agent (kernel)",
        "agent CPU, % of a core",
        "etcd members' CPU, % of a core",
        "the same, idle before the job",
    ]
    text = table(header, rows, markdown=True)
    tcp = {w.run: w.requests_per_s(per_check) for w in by_backend["tcp"]}
    etcd = {w.run: w.requests_per_s(per_check) for w in by_backend["etcd"]}
    ratios = pair_ratios(etcd, tcp)  # type: ignore[arg-type]
    if ratios:
        text += f"\n\netcd/tcp, requests per agent, run by run: {ratio_cell(ratios)}"
    cal = "; ".join(
        f"{b}: " + ", ".join(f"{op} {n:.2f}" for op, n in ops.items())
        for b, ops in calibration.items()
    )
    text += (
        f"\n\nCalibration, data segments sent per call by a client of this process "
        f"({CALIBRATION_CALLS} calls each): {cal}.\n"
        "The agent, by its code: a wait on `c<cycle>/next` a second in its restart watch's "
        "thread (one request on TCPStore, one watch on etcd), its own `check` of the key every "
        "2 s (a safety net), and the live record every 2 s: about 2 requests/s per agent "
        f"(until 2026-11-28: a `check` every monitor interval, {MONITOR_INTERVAL_S} s: 10/s).\n"
    )
    return text


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="jobs per store, alternating")
    parser.add_argument("--window", type=float, default=20.0, help="seconds counted per job")
    parser.add_argument("--warm", type=int, default=20, help="steps every rank logs first")
    parser.add_argument(
        "--idle", type=float, default=5.0, help="seconds of etcd's idle CPU before each job"
    )
    parser.add_argument("--steps", type=int, default=5000, help="the job's length (killed)")
    parser.add_argument(
        "--backend", choices=["tcp", "etcd", "both"], default="both", help="which stores"
    )
    sizes = {"runs": 1, "window": 2.0, "warm": 2, "idle": 0.5, "steps": 400}
    args = smoke.parse_args(parser, sizes, argv)
    if args.runs < 1 or args.window <= 0 or args.warm < 1:
        parser.error("--runs, --window and --warm must be positive")
    args.backend = list(BACKENDS) if args.backend == "both" else [args.backend]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    take_charge()
    load = load_average()
    windows: list[Window] = []
    try:
        with contextlib.ExitStack() as stack:
            etcd = stack.enter_context(etcd_cluster()) if "etcd" in args.backend else None
            calibration = calibrate(etcd)
        for run in range(args.runs):
            order = args.backend if run % 2 == 0 else args.backend[::-1]
            for backend in order:
                window = measure(backend, run, args)
                windows.append(window)
                rate = window.requests_per_s(calibration["tcp"]["check"])
                progress(
                    f"{backend} run {run}: {rate:.2f} requests/s per agent, "
                    f"{window.segments_per_s():.2f} segments/s per agent, {window.steps} steps "
                    f"in {window.seconds:.1f} s"
                )
    except (EtcdMissing, AssertionError, RuntimeError) as exc:
        print(f"store_requests: FAILED: {exc}", file=sys.stderr)
        return 1
    print(report(windows, calibration))
    print(machine_line(load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
