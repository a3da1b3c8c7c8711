"""One node's state as its events tell it: a pure fold, read live by the metrics and the page.

`NodeView.apply(record)` takes the records `EventLog` writes, in order (live, as a subscriber,
or from `events-<node>.jsonl`); nothing else changes it. Every label value it keeps comes from a
closed set (failure kinds, health findings, states) or is bounded by the node's ranks, so the
metrics built from it stay bounded however long the job runs.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

LAST_FAILURES = 5
"""Failures a view keeps in full (the counters keep every one)."""
ELSEWHERE = "another node"
"""A restart's cause when this node saw no failure of its own in that cycle."""


class NodeState(str, enum.Enum):
    JOINING = "joining"
    STANDBY = "standby"
    STARTING = "starting"
    STEPPING = "stepping"
    FAILING = "failing"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    FINISHED = "finished"
    UNHEALTHY = "unhealthy"
    EXITED = "exited"
    LOST = "lost"
    """Told by another node (`node_lost`); the view of a lost node itself never says it."""


_AFTER: Mapping[str, NodeState] = {
    "health_check": NodeState.JOINING,
    "rendezvous_done": NodeState.STARTING,
    "standby": NodeState.STANDBY,
    "workers_started": NodeState.STARTING,
    "stepping": NodeState.STEPPING,
    "hang": NodeState.FAILING,
    "failure": NodeState.FAILING,
    "stop_done": NodeState.RESTARTING,
    "restart": NodeState.RESTARTING,
    "unhealthy": NodeState.UNHEALTHY,
    "exit": NodeState.EXITED,
}
"""The state an event leaves the node in; events not listed leave the state as it was."""


@dataclasses.dataclass
class Tier:
    """The newest complete iteration a checkpoint tier holds, as this node saw it."""

    iteration: int
    ts: float
    seconds: float | None = None
    """How long its replication took (replicated tier)."""
    lag: float | None = None
    """Seconds from the part's write to its replicas (replicated tier)."""
    stall: float | None = None
    """The longest time a rank's latest save blocked its training (local tier)."""


@dataclasses.dataclass
class NodeView:
    node: str
    state: NodeState = NodeState.JOINING
    since: float = 0.0
    """When the state began (wall clock)."""
    cycle: int = 0
    group_rank: int | None = None
    ranks: tuple[int, ...] = ()
    stepping: tuple[int, ...] = ()
    """This node's ranks that have stepped in the current cycle."""
    exit_code: int | None = None
    restarts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Restarts by cause: the kind of this node's own failure in the cycle, else ELSEWHERE."""
    failures: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """This node's own failures (not the consequences of another's) by kind."""
    last_failures: collections.deque[dict[str, Any]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=LAST_FAILURES)
    )
    health: collections.Counter[tuple[str, bool]] = dataclasses.field(
        default_factory=collections.Counter
    )
    """Health findings by (finding, fault)."""
    stragglers: dict[str, Any] | None = None
    """The last straggler report this node wrote (the reporting node's): seq, worst, median."""
    tiers: dict[str, Tier] = dataclasses.field(default_factory=dict)
    _cause: dict[int, str] = dataclasses.field(default_factory=dict)

    def apply(self, record: Mapping[str, Any]) -> None:
        kind, ts = record.get("event"), float(record.get("ts", 0.0))
        cycle = record.get("cycle")
        if isinstance(cycle, int) and not isinstance(cycle, bool):
            self.cycle = cycle
        if (handler := _HANDLERS.get(str(kind))) is not None:
            handler(self, record)
        state = _AFTER.get(str(kind))
        if kind == "last_progress":
            state = NodeState.FINISHED if record.get("before") == "finished" else NodeState.STOPPING
        if state is not None and state is not self.state:
            self.state, self.since = state, ts

    def _formed(self, record: Mapping[str, Any]) -> None:
        rank = record.get("group_rank")
        self.group_rank = rank if isinstance(rank, int) else None
        self.stepping = ()

    def _started(self, record: Mapping[str, Any]) -> None:
        self.ranks = tuple(r for r in record.get("ranks") or () if isinstance(r, int))
        self.stepping = ()

    def _stepped(self, record: Mapping[str, Any]) -> None:
        self.stepping = tuple(r for r in record.get("ranks") or () if isinstance(r, int))

    def _failed(self, record: Mapping[str, Any]) -> None:
        kind = str(record.get("kind"))
        if not record.get("secondary"):
            self.failures[kind] += 1
            self._cause[self.cycle] = kind
        else:
            self._cause.setdefault(self.cycle, kind)
        keep = ("kind", "detail", "where", "message", "decision", "rank", "secondary")
        entry = {k: record.get(k) for k in keep if record.get(k) is not None}
        self.last_failures.append({"cycle": self.cycle, "ts": record.get("ts"), **entry})

    def _restarted(self, record: Mapping[str, Any]) -> None:
        self.restarts[self._cause.pop(self.cycle, ELSEWHERE)] += 1

    def _health(self, record: Mapping[str, Any]) -> None:
        self.health[(str(record.get("finding")), bool(record.get("fault")))] += 1

    def _straggler_report(self, record: Mapping[str, Any]) -> None:
        self.stragglers = {k: record.get(k) for k in ("seq", "ranks", "worst", "median", "ts")}

    def _held(self, record: Mapping[str, Any]) -> None:
        self._tier("local", record, None, None, record.get("stall"))

    def _replicated(self, record: Mapping[str, Any]) -> None:
        self._tier("replicated", record, record.get("seconds"), record.get("lag"))

    def _tier(self, name: str, record: Mapping[str, Any], *timing: Any) -> None:
        iteration = record.get("iteration")
        held = self.tiers.get(name)
        if isinstance(iteration, int) and (held is None or iteration >= held.iteration):
            self.tiers[name] = Tier(iteration, float(record.get("ts", 0.0)), *timing)

    def _exited(self, record: Mapping[str, Any]) -> None:
        code = record.get("code")
        self.exit_code = code if isinstance(code, int) else None

    def summary(self) -> dict[str, Any]:
        """The view as JSON-able data (what the status page shows of a node)."""
        return {
            "node": self.node,
            "state": self.state.value,
            "since": self.since,
            "cycle": self.cycle,
            "group_rank": self.group_rank,
            "ranks": list(self.ranks),
            "stepping": list(self.stepping),
            "exit_code": self.exit_code,
            "restarts": sum(self.restarts.values()),
            "failures": dict(self.failures),
            "health": [
                {"finding": f, "fault": fault, "count": n} for (f, fault), n in self.health.items()
            ],
            "tiers": {name: dataclasses.asdict(t) for name, t in self.tiers.items()},
        }


_HANDLERS = {
    "rendezvous_done": NodeView._formed,
    "workers_started": NodeView._started,
    "stepping": NodeView._stepped,
    "failure": NodeView._failed,
    "restart": NodeView._restarted,
    "health_finding": NodeView._health,
    "straggler_report": NodeView._straggler_report,
    "ckpt_held": NodeView._held,
    "ckpt_replicated": NodeView._replicated,
    "exit": NodeView._exited,
}
