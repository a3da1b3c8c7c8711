"""The straggler detector's agent side, as a node service (see `ftrun.straggler`).

Every node: the rank monitor hands the ranks' timing batches to `on_timings` (an enqueue on
the monitor thread); this service's thread wakes once per report interval, closes the interval
(`NodeCollector`) and publishes the node's record in the store (`Board`). The node of group
rank 0 then reads every node's record, computes the report (`assemble`), logs it as NVRx
prints it, writes `straggler_report`/`straggler` events and decides (`decide`); every node
writes the latest report to `<job dir>/straggler-report.json` for its workers, and the node
told to leave asks its agent to exclude it (a `ServiceRequest` on the inbox: the agent's
ExcludeThisNode path). The settings may change at runtime (`ControlFile`).

Nothing here can stop training: a store or file error is logged and the next interval retries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import statistics
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch.distributed import Store

from ftrun.errors import ConfigError
from ftrun.rank_monitor.timings import TimingBatch
from ftrun.rank_monitor.workload import WorkloadAction
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService, ServiceContext, ServiceRequest
from ftrun.straggler.assemble import assemble_columns, decode_node, encode_node
from ftrun.straggler.board import Board
from ftrun.straggler.channel import write_report
from ftrun.straggler.collector import Leader, NodeCollector
from ftrun.straggler.config import CONTROL_FILE, ControlFile, StragglerConfig
from ftrun.straggler.decide import Decision, decide
from ftrun.straggler.report import Report, report_text

log = logging.getLogger("ftrun.agent")
_WORST_IN_EVENTS = 32
"""Ranks whose scores each `straggler_report` event carries (the worst ones)."""


class StragglerService(NodeService):
    name = "straggler detector"

    def __init__(
        self,
        config: StragglerConfig,
        store: Store,
        run_id: str,
        node: str,
        job_dir: Path,
        log_dir: Path,
        min_nodes: int,
        emit: Callable[..., None],
        post: Callable[[object], None],
    ) -> None:
        self.config = self._initial = config
        self._board = Board(store, run_id)
        self._node, self._job_dir, self._min_nodes = node, job_dir, min_nodes
        self._emit, self._post = emit, post
        self._control = ControlFile(log_dir / CONTROL_FILE)
        self._batches: queue.SimpleQueue[TimingBatch] = queue.SimpleQueue()
        self._collector = NodeCollector(node, config.history)
        self._leader = Leader()
        self._lock = threading.Lock()
        self._round: Round | None = None
        self._report_seq: int | None = None
        self._excluded: int | None = None  # the cycle in which this leader decided one
        self._asked: int | None = None  # the cycle in which this node asked to leave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="straggler", daemon=True)
        self._thread.start()

    # ---- hooks -------------------------------------------------------------------------------

    def on_timings(self, batch: TimingBatch) -> None:
        """The rank monitor's callback (its thread): enqueue only."""
        self._batches.put(batch)

    def on_round(self, rnd: Round) -> None:
        with self._lock:
            self._round = rnd
            self._report_seq = None
            self._collector.new_cycle()
            self._leader.new_cycle()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        with self._lock:
            self._round = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---- the interval loop -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.config.report_interval):
            try:
                self._tick()
            except Exception:  # the store may be gone, or a bug: never take the agent down
                log.exception("straggler detector: this interval's report failed")

    def _tick(self) -> None:
        self._retune()
        with self._lock:
            rnd = self._round
            while True:
                try:
                    batch = self._batches.get_nowait()
                except queue.Empty:
                    break
                if rnd is not None:
                    self._collector.add(batch)
            if rnd is None or not self.config.enabled:
                return
            records = self._collector.close_interval()
        if records is not None:
            raw = encode_node(self._collector.seq, self._node, records)
            self._board.publish_node(rnd.number, self._node, raw)
        if rnd.group_rank == 0:
            self._report(rnd)
        else:
            self._follow(rnd)

    def _retune(self) -> None:
        try:
            overrides = self._control.changed()
            if overrides is None:
                return
            new = self._initial.with_overrides(overrides)  # the file holds every override
        except ConfigError as exc:
            log.warning("straggler detector: settings unchanged: %s", exc)
            return
        if new != self.config:
            log.info("straggler detector: settings now %s", _describe(new))
            self.config = new

    # ---- the reporting node ------------------------------------------------------------------

    def _report(self, rnd: Round) -> None:
        raws = self._board.read_nodes(rnd.number, [n.node for n in rnd.nodes])
        records = {}
        for node, raw in raws.items():
            try:
                records[node] = decode_node(raw)
            except ValueError as exc:
                log.warning("straggler detector: %s's record: %s", node, exc)
        fresh = self._leader.fresh(records, [n.node for n in rnd.nodes])
        if fresh is None:
            return
        report = assemble_columns(fresh, self._leader.seq)
        decision = decide(
            report, self.config, [n.node for n in rnd.nodes], self._min_nodes,
            len(rnd.standby), self._excluded == rnd.number,
        )  # fmt: skip
        if decision.exclude is not None:
            self._excluded = rnd.number
        data = {**report.to_json(), "cycle": rnd.number, "exclude": decision.exclude}
        self._board.publish_report(rnd.number, data)
        self._publish_locally(data, rnd)
        self._log(report, decision, rnd)
        if decision.action == "stop":
            why = "; ".join(f.describe() for f in decision.findings[:3])
            self._post(ServiceRequest(self.name, WorkloadAction.ShutdownWorkload, why))

    def _log(self, report: Report, decision: Decision, rnd: Round) -> None:
        text = report_text(report, self.config.scores_to_print)
        log.info("straggler report %d of cycle %d:\n%s", report.seq, rnd.number, text.rstrip())
        self._emit("straggler_report", **_scores_event(report))
        if not decision.findings:
            return
        for finding in decision.findings[: self.config.scores_to_print]:
            log.warning("STRAGGLER: %s", finding.describe())
        if decision.note:
            log.warning("straggler detector: %s", decision.note)
        self._emit(
            "straggler",
            seq=report.seq,
            ranks=sorted({f.rank for f in decision.findings}),
            nodes=sorted({f.node for f in decision.findings}),
            findings=[dataclasses.asdict(f) for f in decision.findings[:_WORST_IN_EVENTS]],
            action=decision.action,
            exclude=decision.exclude,
            note=decision.note or None,
        )

    # ---- every node ----------------------------------------------------------------------------

    def _follow(self, rnd: Round) -> None:
        data = self._board.read_report(rnd.number)
        if data is not None and data.get("seq") != self._report_seq:
            self._publish_locally(data, rnd)

    def _publish_locally(self, data: dict[str, Any], rnd: Round) -> None:
        self._report_seq = data.get("seq")
        with contextlib.suppress(OSError):  # the job dir goes away at shutdown
            write_report(self._job_dir, data)
        if data.get("exclude") == self._node and self._asked != rnd.number:
            self._asked = rnd.number
            why = f"straggler report {data.get('seq')}: this node hosts the slowest straggler"
            self._post(ServiceRequest(self.name, WorkloadAction.ExcludeThisNode, why))


def _scores_event(report: Report) -> dict[str, Any]:
    """The interval's worst ranks (each by its lowest score of any kind) and the median."""
    lowest: dict[int, float] = {}
    kinds = [report.gpu_relative_perf_scores, report.gpu_individual_perf_scores]
    kinds += [*report.section_relative_perf_scores.values()]
    kinds += [*report.section_individual_perf_scores.values()]
    for scores in kinds:
        for rank, score in scores.items():
            lowest[rank] = min(score, lowest.get(rank, score))
    worst = sorted(lowest.items(), key=lambda item: (item[1], item[0]))[:_WORST_IN_EVENTS]
    return {
        "seq": report.seq,
        "ranks": len(lowest),
        "worst": [[rank, report.rank_to_node.get(rank), round(s, 4)] for rank, s in worst],
        "median": round(statistics.median(lowest.values()), 4) if lowest else None,
    }


def _describe(config: StragglerConfig) -> str:
    fields = dataclasses.asdict(config)
    fields["action"] = config.action.value
    return ", ".join(f"{key}={value}" for key, value in fields.items())


def straggler_service(context: ServiceContext) -> StragglerService:
    """The `ServiceFactory` the builder hands the agent."""
    config = context.config
    service = StragglerService(
        config.straggler, context.store, config.rendezvous.run_id, context.node,
        context.job_dir, context.log_dir, config.rendezvous.min_nodes, context.emit,
        context.post,
    )  # fmt: skip
    context.observe_timings(service.on_timings)
    return service
