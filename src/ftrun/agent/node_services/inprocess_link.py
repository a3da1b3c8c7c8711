"""The agent's side of the in-process tier (`ftrun.inprocess_protocol` says the protocol).

The wrapped ranks' reports arrive on the inbox (the rank monitor's `InprocessNote`s) and are
taken here on the agent's own thread: each becomes this node's event (`inprocess_recovered`
once per restart iteration, `inprocess_left`, `inprocess_gave_up`: `ftrun report`, the metrics
and the status page read them) and updates what the ladder's decisions read: whether this
cycle's ranks wrap, and whether the budget still allows an in-process restart. The agent
interrupts the ranks' iteration by writing into their coordination store what a failing rank
would: through its own store client when they coordinate in the job's store, as they do on
c10d; else (etcd: rank 0 serves their store) through one client per cycle, made at the first
interruption. Nothing is kept on disk; a new cycle starts with a fresh view and budget (its
ranks are new processes).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterable

from torch.distributed import PrefixStore, Store, TCPStore

from ftrun.config.agent import AgentConfig
from ftrun.environment import Env
from ftrun.inprocess_protocol import (
    Interruption,
    Iteration,
    Report,
    ReportKind,
    RestartBudget,
    cause_text,
    newest_iteration,
)
from ftrun.rank_monitor.protocol import InprocessNote
from ftrun.rendezvous.ranks import Round
from ftrun.services import Emit, NodeService

log = logging.getLogger("ftrun.agent")

_CONNECT_TIMEOUT = datetime.timedelta(seconds=2)
"""The agent loop waits this long at most for the ranks' own store (then escalates)."""
_ENDINGS = {ReportKind.LEFT: "inprocess_left", ReportKind.GAVE_UP: "inprocess_gave_up"}
"""A rank's report that it left the iterations, or gave up on them: its event."""


class InprocessLink(NodeService):
    """This node's view of its wrapped ranks, and the way to interrupt them."""

    name = "in-process link"

    def __init__(self, store: Store, config: AgentConfig, run_id: str, emit: Emit) -> None:
        """`store`: the job's store; wrapped ranks coordinate in it when it is a c10d
        TCPStore (its real address: with --standalone the endpoint's port is 0), which outlives
        every worker (rank 0 can be lost and replaced) and needs no port next to MASTER_PORT
        (NVRx's MASTER_PORT + 1 may be taken). On etcd, or a store `ftrun store` serves (its
        restarts would take the ranks' keys with them), the wrapper serves its own, as under
        torchrun."""
        shared = isinstance(store, TCPStore)
        self._store = store if shared else None
        self._address = f"{store.host}:{store.port}" if shared else None
        self._run_id, self._emit = run_id, emit
        self.budget: RestartBudget = config.inprocess_budget
        self._abort_timeout = config.inprocess_abort_timeout
        self._new_cycle()

    def _new_cycle(self) -> None:
        self._wrapped: Report | None = None
        self._restarts: list[float] = []  # when each restart iteration recovered
        self._causes: list[str] = []  # and its root cause, oldest first
        self._seen: set[int] = set()  # iterations told already (every local rank reports each)
        self._client: Store | None = None

    # ---- the node service ------------------------------------------------------------------

    def worker_env(self, rnd: Round) -> dict[str, str]:
        env = {Env.INPROCESS_BUDGET: self.budget.to_env(),
               Env.INPROCESS_ABORT_TIMEOUT: f"{self._abort_timeout:g}"}  # fmt: skip
        if self._address is not None:
            env[Env.INPROCESS_STORE] = self._address
            env[Env.INPROCESS_PREFIX] = f"inprocess/{self._run_id}/{rnd.number}"
        return env

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self._new_cycle()

    # ---- what the ranks say ----------------------------------------------------------------

    def take(self, note: InprocessNote, cycle: int) -> None:
        """A rank's report, of this cycle or an earlier one's straggler (ignored)."""
        report = note.report
        if report.cycle is not None and report.cycle != cycle:
            return
        if report.kind is ReportKind.WRAPPED:
            self._wrapped = self._wrapped or report
        elif report.kind is ReportKind.RECOVERED and report.iteration not in self._seen:
            self._recovered(report)
        elif report.kind in _ENDINGS:
            self._emit(_ENDINGS[report.kind], rank=note.rank, iteration=report.iteration,
                       why=report.why)  # fmt: skip

    def _recovered(self, report: Report) -> None:
        self._seen.add(report.iteration)
        self._restarts.append(time.monotonic())
        self._causes.append(cause_text(report.cause))
        cause = report.cause or Interruption(None, "?", "", 0.0)
        who = "" if cause.rank is None else f" on rank {cause.rank}"
        log.warning("in-process restart: iteration %d -> %d after %s%s: %s (all ready %ss after "
                    "it)", report.iteration, report.iteration + 1, cause.kind, who,
                    cause.why[:300], report.seconds)  # fmt: skip
        self._emit("inprocess_recovered", iteration=report.iteration, kind=cause.kind,
                   from_rank=cause.rank, why=cause.why[:300], seconds=report.seconds)  # fmt: skip

    def wrapped(self) -> bool:
        """Whether this cycle's ranks run the wrapper (one said so)."""
        return self._wrapped is not None

    def spent(self) -> str | None:
        """Why the budget allows no further in-process restart this cycle, or None."""
        return self.budget.exceeded(self._restarts, self._causes, time.monotonic())

    # ---- interrupting them -----------------------------------------------------------------

    def interrupt(self, ranks: tuple[int, ...], kind: str, why: str) -> bool:
        """End the wrapped ranks' current iteration; False if their store cannot be reached
        (the caller escalates)."""
        if self._wrapped is None:
            return False
        try:
            store = PrefixStore(self._wrapped.prefix, self._connect(self._wrapped.address))
            iteration = Iteration(store, newest_iteration(store), world_size=0)
            for rank in ranks:
                iteration.interrupt(Interruption(rank, kind, why, time.time()))
        except (RuntimeError, ValueError) as error:  # DistStoreError, a bad address
            log.warning("in-process: cannot reach the ranks' store at %s: %s",
                        self._wrapped.address, error)  # fmt: skip
            return False
        log.warning("in-process: %s: the wrapped ranks restart iteration %d", why,
                    iteration.number)  # fmt: skip
        return True

    def _connect(self, address: str) -> Store:
        if self._store is not None and address == self._address:
            return self._store
        if self._client is None:
            host, _, port = address.rpartition(":")
            self._client = TCPStore(host, int(port), is_master=False, timeout=_CONNECT_TIMEOUT)
        return self._client
