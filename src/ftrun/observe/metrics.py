"""Every agent's Prometheus metrics: a `prometheus_client` collector read at scrape time.

The series come from the node's `NodeView` and `NodeTimings` (its events, folded as they are
written: counts, states, durations), the rank monitor's progress snapshot (iteration, progress
age, timeouts in force), and, on the agent that serves the status page, the job's status (ETTR
and the time lost, the report's definitions).
Nothing is updated on the training path: a scrape reads what the agent already holds.

Cardinality, at 1,024 nodes x 8 ranks: labels are `job`, `node`, and where they apply `rank`
(this node's ranks only: 8 per agent), `cause`/`kind` (failure kinds, a closed set), `state`
(`NodeState`), `finding` (health findings: Xid numbers and NVML readings, a closed set),
`section` (the sections the workers time, at most the monitor's 256, in practice a handful),
`tier` (checkpoints: local, replicated; recoveries: the policy's decisions, a closed set).
Durations are histograms with fixed buckets (`observe.timings`): 23 series per agent. An agent
serves about 65 + 3 x its ranks series, 90 at 8 ranks: about 92,000 for the whole job;
stragglers add the worst 8 ranks' scores on the reporting node. With the health watch, each of
the launcher's GPUs (`gpu`: at most 8) adds 5 series and one per slowdown reason in force.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ftrun.eventlog.job_status import SHOWN_STRAGGLERS
from ftrun.eventlog.node_view import NodeState, NodeView
from ftrun.nvml import GpuSnapshot
from ftrun.observe.timings import Buckets, NodeTimings
from ftrun.rank_monitor.records import ProgressSnapshot


class NodeMetrics(Collector):
    """The node's series; `apply` takes every event record (an `EventLog` subscriber)."""

    def __init__(
        self,
        job: str,
        node: str,
        progress: Callable[[], Sequence[ProgressSnapshot]],
        job_status: Callable[[], Mapping[str, Any] | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        gpus: Callable[[], Sequence[GpuSnapshot]] = tuple,
    ) -> None:
        """`progress`: the rank monitor's snapshot (its monotonic clock is `clock`);
        `job_status`: the status page's document, on the agent that serves it, else None;
        `gpus`: what the health watch last read of each of the node's GPUs."""
        self._job, self._node = job, node
        self._progress, self._job_status, self._clock = progress, job_status, clock
        self._gpus = gpus
        self._view = NodeView(node)
        self._timings = NodeTimings()
        self._lock = threading.Lock()

    def apply(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            self._view.apply(record)
            self._timings.apply(record)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            view = self._view
            yield from self._node_series(view)
            yield from self._checkpoint_series(view)
            yield from self._straggler_series(view)
            yield from self._timing_series(self._timings)
        yield from self._rank_series(self._progress(), self._clock())
        yield from self._gpu_series(self._gpus())
        status = self._job_status()
        if status and not status.get("waiting"):
            yield from self._job_series(status)

    def _family(
        self, kind: type, name: str, doc: str, *labels: str,
        values: Mapping[tuple[Any, ...], float] | None = None,
    ) -> Any:  # fmt: skip
        """A family of this node's series; `values`: each series' value by its `labels`' values."""
        family = kind(name, doc, labels=["job", "node", *labels])
        for key, value in (values or {}).items():
            family.add_metric([self._job, self._node, *key], value)
        return family

    def _node_series(self, view: NodeView) -> Iterator[Metric]:
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "ftrun_cycle", "The job-wide cycle number.",
                           values={(): view.cycle})  # fmt: skip
        yield self._family(
            gauge, "ftrun_node_state", "1 for the node's current state.", "state",
            values={(each.value,): 1.0 if each is view.state else 0.0 for each in NodeState},
        )  # fmt: skip
        yield self._family(
            counter, "ftrun_restarts", "Restarts this node went through, by the kind of its own "
            "failure in that cycle ('another node': none of its own).", "cause",
            values={(cause,): n for cause, n in view.restarts.items()},
        )  # fmt: skip
        yield self._family(
            counter, "ftrun_failures", "This node's own failures, by kind.", "kind",
            values={(kind,): n for kind, n in view.failures.items()},
        )  # fmt: skip
        yield self._family(
            counter, "ftrun_health_findings", "Health findings while training (fault: acted on; "
            "else a degradation, logged).", "finding", "fault",
            values={(f, str(fault).lower()): n for (f, fault), n in view.health.items()},
        )  # fmt: skip
        yield self._family(gauge, "ftrun_ranks", "The node's ranks in the current cycle.",
                           values={(): len(view.ranks)})  # fmt: skip
        stepping = len(view.stepping) if view.state is NodeState.STEPPING else 0
        yield self._family(
            gauge, "ftrun_ranks_stepping", "The node's ranks stepping now: every one has shown "
            "progress this cycle (0 outside the stepping state).", values={(): stepping},
        )  # fmt: skip

    def _checkpoint_series(self, view: NodeView) -> Iterator[Metric]:
        base = [self._job, self._node]
        newest = self._family(
            GaugeMetricFamily, "ftrun_checkpoint_iteration", "The newest iteration this node "
            "holds whole (local) or has copied to its peers (replicated).", "tier",
        )  # fmt: skip
        lag = self._family(
            GaugeMetricFamily, "ftrun_checkpoint_replication_lag_seconds",
            "From the newest replicated part's write to its last copy.",
        )  # fmt: skip
        stall = self._family(
            GaugeMetricFamily, "ftrun_checkpoint_save_stall_seconds",
            "The longest time the latest save of one of the node's ranks blocked its training.",
        )  # fmt: skip
        for tier, held in view.tiers.items():
            newest.add_metric([*base, tier], held.iteration)
            if held.lag is not None:
                lag.add_metric(base, held.lag)
            if held.stall is not None:
                stall.add_metric(base, held.stall)
        yield from (newest, lag, stall)

    def _straggler_series(self, view: NodeView) -> Iterator[Metric]:
        report = view.stragglers
        if not report:
            return
        score = GaugeMetricFamily(
            "ftrun_straggler_score", "The lowest performance score (0..1) of the worst ranks, "
            "from the last straggler report (on the reporting node).",
            labels=["job", "node", "rank"],
        )  # fmt: skip
        for rank, node, value in (report.get("worst") or [])[:SHOWN_STRAGGLERS]:
            score.add_metric([self._job, str(node), str(rank)], value)
        yield score

    def _timing_series(self, timings: NodeTimings) -> Iterator[Metric]:
        yield self._family(
            CounterMetricFamily, "ftrun_recoveries", "This node's own failures by the rung of "
            "the escalation ladder the policy chose (tier) and their kind (cause).",
            "tier", "cause", values=timings.recoveries,
        )  # fmt: skip
        yield self._histogram(
            "ftrun_recovery_duration_seconds", "From the node's last progress before a failure "
            "stopped its workers to its ranks stepping again.", timings.recovery,
        )  # fmt: skip
        yield self._histogram(
            "ftrun_rendezvous_duration_seconds", "Rendezvous rounds, from joining to the round "
            "formed.", timings.rendezvous,
        )  # fmt: skip

    def _histogram(self, name: str, doc: str, buckets: Buckets) -> Metric:
        family = self._family(HistogramMetricFamily, name, doc)
        family.add_metric(
            [self._job, self._node],
            [(floatToGoString(bound), n) for bound, n in buckets.cumulative()],
            sum_value=buckets.total,
        )
        return family

    def _rank_series(self, snapshot: Sequence[ProgressSnapshot], now: float) -> Iterator[Metric]:
        gauge = GaugeMetricFamily
        yield self._family(
            gauge, "ftrun_rank_iteration", "The iteration the rank last reported.", "rank",
            values={(str(r.rank),): r.last_iteration for r in snapshot
                    if r.last_iteration is not None},
        )  # fmt: skip
        yield self._family(
            gauge, "ftrun_rank_last_progress_age_seconds",
            "Seconds since the rank's last heartbeat or section end.", "rank",
            values={(str(r.rank),): max(now - r.last_progress, 0.0) for r in snapshot
                    if r.last_progress is not None},
        )  # fmt: skip
        in_force = [r.timeouts for r in snapshot if r.timeouts is not None]
        heartbeats = [t.heartbeat for t in in_force if t.heartbeat]
        sections: dict[str, float] = {}
        for timeouts in in_force:
            for name, value in timeouts.sections.items():
                if value is not None:
                    sections[name] = max(value, sections.get(name, 0.0))
        yield self._family(
            gauge, "ftrun_heartbeat_timeout_seconds",
            "The heartbeat timeout in force (the longest of the node's ranks).",
            values={(): max(heartbeats)} if heartbeats else None,
        )  # fmt: skip
        yield self._family(
            gauge, "ftrun_section_timeout_seconds",
            "Section timeouts in force (the longest of the node's ranks).", "section",
            values={(name,): value for name, value in sections.items()},
        )  # fmt: skip

    def _gpu_series(self, gpus: Sequence[GpuSnapshot]) -> Iterator[Metric]:
        """Each GPU the health watch reads (this launcher's own: `gpu` is NVML's index)."""
        if not gpus:
            return
        gauges = [
            ("ftrun_gpu_memory_used_bytes", "Device memory in use.", "memory_used_bytes"),
            ("ftrun_gpu_memory_total_bytes", "Device memory.", "memory_total_bytes"),
            ("ftrun_gpu_utilization_ratio", "The share of NVML's last sample period in which a "
             "kernel ran.", "utilization"),
            ("ftrun_gpu_uncorrected_ecc_errors", "The volatile uncorrected ECC error count.",
             "uncorrected_ecc"),
        ]  # fmt: skip
        for name, doc, field in gauges:
            yield self._family(GaugeMetricFamily, name, doc, "gpu", values={
                (str(gpu.gpu),): value for gpu in gpus
                if (value := getattr(gpu, field)) is not None})  # fmt: skip
        yield self._family(CounterMetricFamily, "ftrun_gpu_xid_events", "Xid events since the "
                           "launcher started.", "gpu",
                           values={(str(gpu.gpu),): gpu.xids for gpu in gpus})  # fmt: skip
        throttled = {(str(gpu.gpu), reason): 1 for gpu in gpus for reason in gpu.throttled}
        yield self._family(GaugeMetricFamily, "ftrun_gpu_throttled", "1 for each slowdown "
                           "reason in force.", "gpu", "reason", values=throttled)  # fmt: skip

    def _job_series(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        job = [self._job]
        values = (
            ("ftrun_job_ettr_ratio", "Effective training time so far / wall time (the report's "
             "definition, from training progress).", status["ettr"]),
            ("ftrun_job_lost_seconds", "Wall time not kept as training so far.", status["lost_s"]),
            ("ftrun_job_wall_seconds", "Wall time since the job's launch.", status["wall_s"]),
            ("ftrun_job_cycle", "The job's current cycle.", status["cycle"]),
            ("ftrun_job_failed_cycles", "Cycles that ended in a failure.", status["restarts"]),
        )  # fmt: skip
        for name, doc, value in values:
            family = GaugeMetricFamily(name, doc, labels=["job"])
            family.add_metric(job, value if math.isfinite(value) else math.nan)
            yield family
