"""Side by side: ft_launcher, torchrun and NVIDIA Resiliency Extension's ft_launcher (issue 7).

The same job under each (2 local launchers x 2 gloo workers of `bench/worker.py`, c10d
rendezvous, `--max-restarts=3`, fresh port and directory per job), launchers interleaved run by
run. Per run and launcher:

1. start-up: launch -> every rank has finished its first step;
2. after `--settle` s of steady stepping, the footprint of each node's launcher ("agent") and its
   non-worker descendants ("helpers": ft_launcher's pre-started spares, NVRx's rank monitors):
   RSS, and CPU % of one core over a `--window` s window;
3. crash recovery: the bench triggers rank 1's `os._exit(1)` -> every rank stepping again;
4. hang recovery (launchers with hang detection, `--ft-rank-heartbeat-timeout=2`): a new job,
   the bench triggers rank 1's hang -> every rank stepping again;
5. heartbeat call cost in a rank: ftrun's client as in bench/heartbeat.py; NVRx's client against
   a real NVRx rank monitor, in NVRx's venv.

torchrun runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: as it comes, torch 2.13's torchrun
cannot restart gloo workers at all (bench/restart.py shows it; see common.TORCHRUN_NO_SHARE).
NVRx is taken from `bench/.nvrx-venv` (see RESULTS.md for how it is installed); without it its
column says so. Ratios are ft_launcher's median over the peer's median, pair by pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
from common import (
    FT,
    NVRX,
    NVRX_BIN,
    TORCHRUN_NO_SHARE,
    Job,
    Launcher,
    Recovery,
    Stats,
    all_started,
    all_stepping,
    await_recovery,
    become_subreaper,
    fault_args,
    job,
    launcher_fault_args,
    load_average,
    machine_line,
    progress,
    ratio,
    table,
    trigger,
    worker_pids,
)

from ftrun.rank_monitor import RankMonitorConfig, RankMonitorServer

STARTUP_WAIT_S = 180.0
HEARTBEAT_TIMEOUT_S = 2.0
HEARTBEAT_TARGET_US = 5.0
IDLE_CPU_TARGET = 1.0
RECOVERY_RATIO_TARGET = 0.5
LABELS = {FT.name: "ft_launcher", TORCHRUN_NO_SHARE.name: "torchrun", NVRX.name: "NVRx"}

NVRX_RANK_CODE = textwrap.dedent(
    """
    import json, multiprocessing, os, statistics, tempfile, time
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer
    def per_call(fn, batch=200, batches=30):
        costs = []
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            costs.append((time.perf_counter() - start) / batch)
            time.sleep(0.002)
        return statistics.median(costs) * 1e6
    if __name__ == "__main__":
        sock = os.path.join(tempfile.mkdtemp(), "rmon.socket")
        os.environ.update(FT_RANK_MONITOR_IPC_SOCKET=sock, RANK="0", LOCAL_RANK="0")
        cfg = FaultToleranceConfig(rank_section_timeouts={"step": 60.0})
        ctx = multiprocessing.get_context("fork")
        server = RankMonitorServer.run_in_subprocess(cfg, sock, mp_ctx=ctx)
        client = RankMonitorClient()
        client.init_workload_monitoring()
        def section():
            client.start_section("step")
            client.end_section("step")
        result = {"send_heartbeat": per_call(client.send_heartbeat)}
        result["section pair"] = per_call(section)
        print(json.dumps(result), flush=True)
        client.shutdown_workload_monitoring()
        server.terminate()
        server.join(10)
    """
)


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Per node: RSS in MB and CPU % of one core, of the agent alone and with its helpers."""

    agent_rss: float
    total_rss: float
    agent_cpu: float
    total_cpu: float


@dataclasses.dataclass
class Samples:
    """Everything measured for one launcher, run by run."""

    started: list[float | None] = dataclasses.field(default_factory=list)
    startup: list[float | None] = dataclasses.field(default_factory=list)
    crash: list[Recovery] = dataclasses.field(default_factory=list)
    hang: list[Recovery] = dataclasses.field(default_factory=list)
    footprint: list[Footprint] = dataclasses.field(default_factory=list)
    heartbeat: list[dict[str, float]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per launcher")
    parser.add_argument("--settle", type=float, default=8.0, help="s of stepping before faults")
    parser.add_argument("--window", type=float, default=10.0, help="s of the idle-CPU window")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parser.parse_args()


# ---- footprint ----------------------------------------------------------------------------------


def cpu_seconds(proc: psutil.Process) -> float | None:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def rss_mb(procs: Sequence[psutil.Process]) -> float:
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def helpers_of(agent: psutil.Process, workers: set[int]) -> list[psutil.Process]:
    try:
        return [p for p in agent.children(recursive=True) if p.pid not in workers]
    except psutil.Error:
        return []


def cpu_percent(procs: Sequence[psutil.Process], window: float) -> list[float]:
    """CPU % of one core of each process over `window` seconds (0 for one that vanished)."""
    before = [cpu_seconds(p) for p in procs]
    start = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - start
    after = [cpu_seconds(p) for p in procs]
    return [
        0.0 if b is None or a is None else 100.0 * (a - b) / elapsed
        for b, a in zip(before, after, strict=True)
    ]


def footprint(run: Job, window: float) -> Footprint:
    """Mean RSS per node; CPU of the busiest node (node 0 also serves the store)."""
    workers = worker_pids(run.out)
    agents = [psutil.Process(p.pid) for p in run.procs]
    helpers = [helpers_of(agent, workers) for agent in agents]
    flat = [*agents, *(h for group in helpers for h in group)]
    cpu = dict(zip([p.pid for p in flat], cpu_percent(flat, window), strict=True))
    agent_rss = [rss_mb([a]) for a in agents]
    total_rss = [rss_mb([a, *h]) for a, h in zip(agents, helpers, strict=True)]
    agent_cpu = [cpu[a.pid] for a in agents]
    total_cpu = [
        cpu[a.pid] + sum(cpu[h.pid] for h in hs) for a, hs in zip(agents, helpers, strict=True)
    ]
    n = len(agents)
    return Footprint(sum(agent_rss) / n, sum(total_rss) / n, max(agent_cpu), max(total_cpu))


# ---- runs ---------------------------------------------------------------------------------------


def steady_then_crash(launcher: Launcher, settle: float, window: float, samples: Samples) -> None:
    """One job: start-up time, footprint while steady, then a triggered crash and its recovery."""
    with job(launcher, (), fault_args("crash", 0, trigger=True)) as run:
        stepping = run.wait(lambda: all_stepping(run.out, run.launched_at), STARTUP_WAIT_S)
        if stepping is None:
            samples.startup.append(None)
            samples.notes.append(f"start-up failed: {run.describe()}")
            return
        samples.startup.append(stepping - run.launched_at)
        samples.started.append(all_started(run.out, run.launched_at) - run.launched_at)
        time.sleep(settle)
        samples.footprint.append(footprint(run, window))
        trigger(run)
        samples.crash.append(await_recovery(run))


def triggered_hang(launcher: Launcher, settle: float) -> Recovery:
    """One job: steady stepping for `settle` s, then a triggered hang and its recovery."""
    extra = launcher_fault_args(launcher, "hang")
    with job(launcher, extra, fault_args("hang", 0, trigger=True)) as run:
        stepping = run.wait(lambda: all_stepping(run.out, run.launched_at), STARTUP_WAIT_S)
        if stepping is None:
            return Recovery(None, None, f"start-up failed: {run.describe()}")
        time.sleep(settle)
        trigger(run)
        return await_recovery(run)


def heartbeat_ftrun() -> dict[str, float]:
    """bench/heartbeat.py's measurement: a real server here, the timed rank in a child."""
    import heartbeat

    config = RankMonitorConfig(rank_section_timeouts={"step": 60.0})
    with (
        tempfile.TemporaryDirectory() as tmp,
        RankMonitorServer(config, job_dir=Path(tmp) / "job") as server,
    ):
        proc = subprocess.Popen(
            [sys.executable, "-c", heartbeat.RANK_CODE],
            env={**server.worker_env(), "RANK": "0"},
            stdout=subprocess.PIPE,
            text=True,
        )
        server.expect_rank(0, proc.pid)
        out, _ = proc.communicate(timeout=300)
    return json.loads(out)


def heartbeat_nvrx() -> dict[str, float]:
    """NVRx's client against NVRx's rank monitor, both in NVRx's venv."""
    proc = subprocess.run(
        [str(NVRX_BIN / "python"), "-c", NVRX_RANK_CODE],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"NVRx heartbeat bench failed ({proc.returncode}): {proc.stderr[-800:]}")
    return json.loads(lines[-1])


HEARTBEAT: dict[str, Callable[[], dict[str, float]]] = {
    FT.name: heartbeat_ftrun,
    NVRX.name: heartbeat_nvrx,
}


def one_round(launcher: Launcher, args: argparse.Namespace, samples: Samples) -> None:
    name = LABELS[launcher.name]
    progress(f"  {name}: start-up, footprint, crash")
    steady_then_crash(launcher, args.settle, args.window, samples)
    if launcher.hang_args is not None:
        progress(f"  {name}: hang")
        samples.hang.append(triggered_hang(launcher, args.settle))
    if launcher.name in HEARTBEAT:
        progress(f"  {name}: heartbeat cost")
        samples.heartbeat.append(HEARTBEAT[launcher.name]())


def measure(launchers: Sequence[Launcher], args: argparse.Namespace) -> dict[str, Samples]:
    results = {launcher.name: Samples() for launcher in launchers}
    for i in range(args.runs):
        progress(f"round {i + 1}/{args.runs}")
        for launcher in launchers:
            one_round(launcher, args, results[launcher.name])
    return results


# ---- the table ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Metric:
    label: str
    values: Callable[[Samples], list[float | None]]
    fmt: str = "{:.2f}"
    target: str = ""
    lower_is_better: bool = True


def _recovered(field: str) -> Callable[[Samples], list[float | None]]:
    return lambda s: [r.to_stepping for r in getattr(s, field)]


def _footprint(field: str) -> Callable[[Samples], list[float | None]]:
    return lambda s: [getattr(f, field) for f in s.footprint]


def _heartbeat(call: str) -> Callable[[Samples], list[float | None]]:
    return lambda s: [h[call] for h in s.heartbeat]


METRICS = [
    Metric("start-up: launch -> all scripts started (s)", lambda s: list(s.started)),
    Metric("start-up: launch -> all ranks stepping (s)", lambda s: list(s.startup)),
    Metric("crash -> all ranks stepping (s)", _recovered("crash"), target="recovery"),
    Metric("hang (2 s timeout) -> all stepping (s)", _recovered("hang"), target="recovery"),
    Metric("send_heartbeat() (us)", _heartbeat("send_heartbeat"), target="heartbeat"),
    Metric("section start+end (us)", _heartbeat("section pair")),
    Metric("agent RSS per node (MB)", _footprint("agent_rss"), "{:.0f}"),
    Metric("agent + helpers RSS per node (MB)", _footprint("total_rss"), "{:.0f}"),
    Metric("idle agent CPU (% of a core)", _footprint("agent_cpu"), target="cpu"),
    Metric("idle agent + helpers CPU (%)", _footprint("total_cpu")),
]


def verdict(metric: Metric, ours: Stats | None, peers: list[Stats | None]) -> str:
    """The metric's target and whether ftrun's median meets it."""
    if metric.target == "" or ours is None:
        return ""
    if metric.target == "heartbeat":
        return _ok(f"<= {HEARTBEAT_TARGET_US:.0f} us", ours.median <= HEARTBEAT_TARGET_US)
    if metric.target == "cpu":
        return _ok(f"<= {IDLE_CPU_TARGET:.0f} %", ours.median <= IDLE_CPU_TARGET)
    best = min((p.median for p in peers if p is not None), default=None)
    if best is None:
        return "<= 0.5x best peer: no peer recovered"
    target = f"<= {RECOVERY_RATIO_TARGET}x best peer"
    if "hang" in metric.label:
        limit = HEARTBEAT_TIMEOUT_S + 1.5
        ok = ours.median <= limit and ours.median <= RECOVERY_RATIO_TARGET * best
        return _ok(f"{target}, <= {limit:.1f} s", ok)
    return _ok(target, ours.median <= RECOVERY_RATIO_TARGET * best)


def _ok(target: str, ok: bool) -> str:
    return f"{target}: {'yes' if ok else 'NO'}"


def metric_row(metric: Metric, names: Sequence[str], results: dict[str, Samples]) -> list[str]:
    stats = {name: Stats.of(metric.values(results[name])) for name in names}
    ours, peers = stats[FT.name], [stats[n] for n in names if n != FT.name]
    cells = [metric.label]
    cells += [stats[n].cell(metric.fmt) if stats[n] else "-" for n in names]
    for peer in peers:
        value = ratio(ours, peer)
        cells.append("-" if value is None else f"{value:.2f}")
    cells.append(verdict(metric, ours, peers))
    return cells


def render(results: dict[str, Samples], markdown: bool) -> str:
    names = list(results)
    peers = [LABELS[n] for n in names if n != FT.name]
    headers = ["metric", *(LABELS[n] for n in names), *(f"ft/{p}" for p in peers), "target"]
    rows = [metric_row(metric, names, results) for metric in METRICS]
    return table(headers, rows, markdown)


def failures(results: dict[str, Samples]) -> str:
    lines = []
    for name, samples in results.items():
        bad = [*samples.notes, *(r.note for r in [*samples.crash, *samples.hang] if not r.ok)]
        if bad:
            lines.append(f"{LABELS[name]}: {len(bad)} failed run(s); the first: {bad[0]}")
    return "\n\n".join(lines)


def launchers() -> list[Launcher]:
    chosen = [FT, TORCHRUN_NO_SHARE]
    if NVRX.available:
        chosen.append(NVRX)
    else:
        progress(f"NVRx not installed ({NVRX.argv[0]} missing): its column is left out")
    return chosen


def main() -> None:
    args = parse_args()
    become_subreaper()
    load = load_average()
    results = measure(launchers(), args)
    print(render(results, args.markdown))
    print(
        "\nmedian (min-max) over runs; RSS = mean per node, CPU = the busier node; "
        "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    )
    print(f"{machine_line(load)}; {args.runs} run(s) per launcher")
    notes = failures(results)
    if notes:
        print("\nRuns that failed:\n" + notes)


if __name__ == "__main__":
    main()
