"""The straggler detector's agent side, as a node service (see `ftrun.straggler`).

Every node: the rank monitor hands the ranks' timing batches to `on_timings` (an enqueue on
the monitor thread); this service's thread wakes once per report interval, closes the interval
(`NodeCollector`) and publishes the node's record in the store (`Board`). The node of group
rank 0 then reads every node's record, computes the report (`assemble`), logs it as NVRx
prints it, writes `straggler_report`/`straggler` events and decides (`decide`); every node
writes the latest report to `<job dir>/straggler-report.json` for its workers, and the node
told to leave asks its agent to exclude it (a `ServiceRequest` on the inbox: the agent's
ExcludeThisNode path). The settings may change at runtime (`ControlFile`).

The interval: the launcher's when given, else the `report_time_interval` the ranks gave
`Detector.initialize` (each rank's first frame; the thread wakes for it), agreed job-wide by the
reporting node, which publishes it with each report (`adopt`). The ranks' `node_name` names
their node in the reports.

Nothing here can stop training: a store or file error is logged and the next interval retries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any

from torch.distributed import Store

from ftrun.config.straggler import (
    CONTROL_FILE,
    DEFAULT_REPORT_INTERVAL,
    ControlFile,
    StragglerConfig,
)
from ftrun.errors import ConfigError
from ftrun.rank_monitor.timings import DetectorSettings, TimingBatch
from ftrun.rank_monitor.workload import WorkloadAction
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService, ServiceContext, ServiceRequest
from ftrun.straggler.adopt import Choice, choose_interval, choose_name, followed, published_interval
from ftrun.straggler.assemble import (
    Columns,
    asked_intervals,
    assemble_columns,
    decode_node,
    encode_node,
)
from ftrun.straggler.board import Board
from ftrun.straggler.channel import write_report
from ftrun.straggler.collector import Leader, NodeCollector
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
        self._asks: dict[int, DetectorSettings] = {}  # this cycle's ranks' settings
        self._published: float | None = None  # the reporting node's interval, this cycle
        self._label: str | None = None  # the node's name in reports (its ranks' node_name)
        self._warned: set[Hashable] = set()  # the disagreements (`Choice.key`) warned about
        self.interval = config.report_interval or DEFAULT_REPORT_INTERVAL
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
        self._wake = threading.Event()  # a rank's settings arrived: the interval may change
        self._thread = threading.Thread(target=self._run, name="straggler", daemon=True)
        self._thread.start()

    # ---- hooks -------------------------------------------------------------------------------

    def on_timings(self, batch: TimingBatch) -> None:
        """The rank monitor's callback (its thread): enqueue only."""
        self._batches.put(batch)
        if batch.settings is not None:
            self._wake.set()

    def on_round(self, rnd: Round) -> None:
        with self._lock:
            self._round = rnd
            self._report_seq = None
            self._asks.clear()
            self._published = None
            self._collector.new_cycle()
            self._leader.new_cycle()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        with self._lock:
            self._round = None

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the interval loop -------------------------------------------------------------------

    def _run(self) -> None:
        began = time.monotonic()
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, began + self.interval - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._drain()
                if woken and time.monotonic() < began + self.interval:
                    continue  # a rank's settings, mid-interval: wait on, maybe for less
                began = time.monotonic()
                self._tick()
            except Exception:  # the store may be gone, or a bug: never take the agent down
                began = time.monotonic()
                log.exception("straggler detector: this interval's report failed")

    def _drain(self) -> None:
        """Take the queued batches: settings to `_asks`, durations to the collector."""
        with self._lock:
            rnd = self._round
            while not self._batches.empty():  # this thread is its only reader
                batch = self._batches.get_nowait()
                if rnd is None:
                    continue
                if batch.settings is not None:
                    self._asks[batch.rank] = batch.settings
                if batch.sections:
                    self._collector.add(batch)
        self._settle()

    def _tick(self) -> None:
        self._retune()
        own, name = self._settle()
        self._warn(name)
        with self._lock:
            rnd = self._round
            if rnd is None or not self.config.enabled:
                return
            records = self._collector.close_interval()
            asks = {rank: s.report_time_interval for rank, s in self._asks.items()}
        if records is not None:
            raw = encode_node(self._collector.seq, self._node, records, self._label, asks)
            self._board.publish_node(rnd.number, self._node, raw)
        if rnd.group_rank == 0:
            self._report(rnd, asks)
        else:
            self._warn(own)  # the reporting node warns for the whole job
            self._follow(rnd)

    def _settle(self) -> tuple[Choice, Choice]:
        """The interval and the node's name in reports, from the launcher's setting, the
        ranks' settings and the reporting node's choice; returns this node's ranks' choices
        (interval, name)."""
        with self._lock:
            asks = dict(self._asks)
        flag = self.config.report_interval
        own = choose_interval(flag, {rank: s.report_time_interval for rank, s in asks.items()})
        name = choose_name(self._node, {rank: s.node_name for rank, s in asks.items()})
        self._label = name.value
        interval = followed(flag, own, self._published)
        if interval != self.interval:
            why = _source(own, self._published)
            log.info("straggler detector: a report every %g s (%s)", interval, why)
            self.interval = interval
        return own, name

    def _warn(self, choice: Choice) -> None:
        if choice.conflict is not None and choice.key not in self._warned:
            self._warned.add(choice.key)
            log.warning("straggler detector: %s", choice.conflict)

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

    def _report(self, rnd: Round, asks: dict[int, float]) -> None:
        records = {}
        for node, raw in self._board.read_nodes(rnd.number, [n.node for n in rnd.nodes]).items():
            try:
                records[node] = decode_node(raw)
            except ValueError as exc:
                log.warning("straggler detector: %s's record: %s", node, exc)
        self._agree(records.values(), asks)
        fresh = self._leader.fresh(records, [n.node for n in rnd.nodes])
        if fresh is None:
            return
        report = assemble_columns(fresh, self._leader.seq)
        agents = {rank: cols.node for cols in fresh for rank in cols.ranks}
        decision = decide(
            report, self.config, [n.node for n in rnd.nodes], self._min_nodes,
            len(rnd.standby), self._excluded == rnd.number, agents,
        )  # fmt: skip
        if decision.exclude is not None:
            self._excluded = rnd.number
        data = {**report.to_json(), "cycle": rnd.number, "exclude": decision.exclude}
        data["interval"] = self.interval
        self._board.publish_report(rnd.number, data)
        self._publish_locally(data, rnd)
        self._log(report, decision, rnd, agents)
        if decision.action == "stop":
            why = "; ".join(f.describe() for f in decision.findings[:3])
            self._post(ServiceRequest(self.name, WorkloadAction.ShutdownWorkload, why))

    def _agree(self, records: Iterable[tuple[int, Columns]], asks: dict[int, float]) -> None:
        """The job's interval, from every node's ranks' asks (this node's own the freshest)."""
        everyone: dict[int, float] = {}
        for _, cols in records:
            everyone.update(asked_intervals(cols))
        job = choose_interval(self.config.report_interval, {**everyone, **asks})
        self._warn(job)
        self._published = job.value
        self._settle()

    def _log(
        self, report: Report, decision: Decision, rnd: Round, agents: Mapping[int, str]
    ) -> None:
        text = report_text(report, self.config.scores_to_print)
        log.info("straggler report %d of cycle %d:\n%s", report.seq, rnd.number, text.rstrip())
        self._emit("straggler_report", **_scores_event(report, agents))
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
        if data is None:
            return
        published = published_interval(data)
        if published is not None and published != self._published:
            self._published = published
            self._settle()
        if data.get("seq") != self._report_seq:
            self._publish_locally(data, rnd)

    def _publish_locally(self, data: dict[str, Any], rnd: Round) -> None:
        self._report_seq = data.get("seq")
        with contextlib.suppress(OSError):  # the job dir goes away at shutdown
            write_report(self._job_dir, data)
        if data.get("exclude") == self._node and self._asked != rnd.number:
            self._asked = rnd.number
            why = f"straggler report {data.get('seq')}: this node hosts the slowest straggler"
            self._post(ServiceRequest(self.name, WorkloadAction.ExcludeThisNode, why))


def _scores_event(report: Report, agents: Mapping[int, str]) -> dict[str, Any]:
    """The interval's worst ranks (each by its lowest score of any kind, with its agent's
    node) and the median."""
    lowest: dict[int, float] = {}
    for _, _, scores in report.score_kinds():
        for rank, score in scores.items():
            lowest[rank] = min(score, lowest.get(rank, score))
    worst = sorted(lowest.items(), key=lambda item: (item[1], item[0]))[:_WORST_IN_EVENTS]
    return {
        "seq": report.seq,
        "ranks": len(lowest),
        "worst": [[rank, agents.get(rank), round(s, 4)] for rank, s in worst],
        "median": round(statistics.median(lowest.values()), 4) if lowest else None,
    }


def _source(own: Choice, published: float | None) -> str:
    if own.source == "launcher":
        return "--ft-straggler-report-interval"
    if published is not None:
        return "the ranks' report_time_interval, as the reporting node chose it"
    if own.source == "default":
        return "no rank gave report_time_interval"
    return "this node's ranks' report_time_interval"


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
