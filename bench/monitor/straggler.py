"""Straggler detection costs: the training path (`detection_section`) and the agents' report.

1. `detection_section` on CPU, per entry, net of the loop: ftrun in-process (no launcher), and
   under a launcher-like setup (a real RankMonitorServer in this process receiving the batches,
   so the amortised send is included). NVRx beside it: its Detector cannot even initialize on a
   machine without CUDA (it loads libcupti at `initialize`), so its cell says why.
2. The agents' side for 1,024 simulated nodes x 8 ranks, 2 sections per rank and 200 steps per
   interval: one node closing its interval (8 ranks' durations -> its record), and the
   reporting node's whole report (1,024 JSON records decoded, relative scores, decision,
   report text, report JSON). NVRx computes its scores on every rank inside the training step
   with collectives: there is no agent-side step to set beside it.

Usage: .venv/bin/python -m bench.monitor.straggler [--markdown] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from bench.common import ROOT, smoke
from bench.common.jobs import NVRX_BIN
from bench.common.report import table
from bench.common.timing import Stopwatch, per_call_us

REPEATS = 7
ENTRIES, NODES = 200_000, 1024
RANKS, STEPS = 8, 200


def per_entry_ns(enter: Callable[[], AbstractContextManager[Any]], entries: int) -> float:
    """Median over REPEATS of the ns per `with enter():` block, net of the loop."""

    def block() -> None:
        with enter():
            pass

    costs = per_call_us(block, REPEATS, entries, net_of_loop=True)
    return statistics.median(costs) * 1e3


def ftrun_local(entries: int) -> float:
    from ftrun.straggler import Detector

    Detector.initialize()
    try:
        return per_entry_ns(
            lambda: Detector.detection_section("step", profile_cuda=False), entries
        )
    finally:
        Detector.shutdown()


def ftrun_launcher(entries: int) -> tuple[float, int]:
    """Per entry with the batches going to a real monitor server; and the batches it got."""
    import queue

    from ftrun.rank_monitor import RankMonitorConfig, RankMonitorServer
    from ftrun.straggler import Detector

    got: queue.SimpleQueue = queue.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        server = RankMonitorServer(RankMonitorConfig(), Path(tmp) / "job", on_timings=got.put)
        with server:
            server.expect_rank(0, os.getpid())
            os.environ.update({**server.worker_env(), "RANK": "0"})
            Detector.initialize()
            try:
                cost = per_entry_ns(
                    lambda: Detector.detection_section("step", profile_cuda=False), entries
                )
            finally:
                Detector.shutdown()
            time.sleep(0.5)
    return cost, got.qsize()


NVRX_PROBE = """
import statistics
import nvidia_resiliency_ext.straggler as s
from bench.common.timing import per_call_us
try:
    s.Detector.initialize()
except Exception as exc:
    print("cannot run:", type(exc).__name__, str(exc).splitlines()[0])
else:
    def block():
        with s.Detector.detection_section("step", profile_cuda=False):
            pass
    print(f"{statistics.median(per_call_us(block, 1, 100000, net_of_loop=True)) * 1e3:.0f}")
"""


def nvrx_cell() -> str:
    python = NVRX_BIN / "python"
    if not python.exists():
        return "not installed"
    out = subprocess.run(
        [str(python), "-W", "ignore", "-c", NVRX_PROBE],
        cwd=ROOT,  # where `bench` imports from
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return (out.stdout.strip().splitlines() or [out.stderr.strip()[-120:]])[-1]


def simulated_records(nodes: int) -> list[bytes]:
    from ftrun.rank_monitor.timings import SectionTimes, TimingBatch
    from ftrun.straggler.assemble import encode_node
    from ftrun.straggler.collector import NodeCollector

    rng = random.Random(0)
    records = []
    for node in range(nodes):
        collector = NodeCollector(f"node{node:04d}")
        for local in range(RANKS):
            rank = node * RANKS + local
            slow = 1.4 if rank == 4242 else 1.0
            sections = tuple(
                SectionTimes(
                    name,
                    gpu,
                    tuple(int(base * slow * rng.uniform(0.97, 1.03)) for _ in range(STEPS)),
                )
                for name, gpu, base in (("step", False, 20_000_000), ("step", True, 18_000_000))
            )
            collector.add(TimingBatch(rank, rank, sections, 0.0))
        records.append(encode_node(1, collector.node, collector.close_interval()))
    return records


def node_interval_ms() -> float:
    """One node closing an interval: 8 ranks x 2 sections x 200 durations -> its record."""
    from ftrun.rank_monitor.timings import SectionTimes, TimingBatch
    from ftrun.straggler.assemble import encode_node
    from ftrun.straggler.collector import NodeCollector

    collector = NodeCollector("node")
    durations = tuple(range(STEPS))
    sections = (SectionTimes("step", False, durations), SectionTimes("step", True, durations))
    batches = [TimingBatch(r, r, sections, 0.0) for r in range(RANKS)]
    times = []
    for _ in range(REPEATS):
        watch = Stopwatch()
        for b in batches:
            collector.add(b)
        encode_node(collector.seq + 1, "node", collector.close_interval())
        times.append(watch.seconds() * 1e3)
    return statistics.median(times)


def leader_report_ms(records: list[bytes]) -> tuple[float, str]:
    from ftrun.config.straggler import StragglerConfig
    from ftrun.straggler.assemble import assemble_columns, decode_node
    from ftrun.straggler.collector import Leader
    from ftrun.straggler.decide import decide
    from ftrun.straggler.report import report_text

    config, names = StragglerConfig(), [f"node{n:04d}" for n in range(len(records))]
    times, found = [], ""
    for seq in range(1, REPEATS + 1):
        watch = Stopwatch()
        decoded = {}
        for raw in records:
            _, cols = decode_node(raw)
            decoded[cols.node] = (seq, cols)
        report = assemble_columns(Leader().fresh(decoded), seq)
        decision = decide(report, config, names, 1, 0, False)
        report_text(report, config.scores_to_print)
        json.dumps(report.to_json())
        times.append(watch.seconds() * 1e3)
        found = ", ".join(
            f"{f.rank}@{f.node} {f.kind} {f.score:.2f}" for f in decision.findings[:2]
        )
    return statistics.median(times), found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--entries", type=int, default=ENTRIES, help="sections per timed batch")
    parser.add_argument("--nodes", type=int, default=NODES, help="simulated nodes (report)")
    args = smoke.parse_args(parser, {"entries": 500, "nodes": 8})
    local = ftrun_local(args.entries)
    launcher, batches = ftrun_launcher(args.entries)
    nvrx = nvrx_cell()
    rows = [
        ["detection_section, CPU, no launcher", f"{local / 1e3:.2f} us", "<= 2 us", nvrx],
        [f"detection_section, CPU, to a monitor ({batches} batches)", f"{launcher / 1e3:.2f} us",
         "<= 2 us", nvrx],
    ]  # fmt: skip
    records = simulated_records(args.nodes)
    node_ms = node_interval_ms()
    leader_ms, found = leader_report_ms(records)
    size = sum(map(len, records)) / len(records)
    rows += [
        [f"node interval close ({RANKS} ranks, {STEPS} steps)", f"{node_ms:.1f} ms", "", "n/a"],
        [f"report, {len(records)} nodes x {RANKS} ranks ({size / 1024:.1f} KiB/node)",
         f"{leader_ms:.1f} ms", "<= 100 ms", "n/a (in-step collectives)"],
    ]  # fmt: skip
    print(table(["measure", "ftrun", "target", "NVRx 0.4.1"], rows, args.markdown))
    print(f"found: {found}")


if __name__ == "__main__":
    main()
