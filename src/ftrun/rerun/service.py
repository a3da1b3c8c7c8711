"""The launcher's part of the re-run state machine, as a node service (registered by the
builder: the agent never imports `ftrun.rerun`).

It reads what this node's ranks tell (`verdicts`): while the workers run, every
`POLL_S`, and once more after they stopped (before the next rendezvous) or finished (before
the job can end).
- `suspect`: a rank's rejected result reproduced in place; this node steps aside for the next
  cycle (`JobControl.step_aside`), so a standby node takes its slot and re-runs the step. The
  ranks then exit 16, which the agent's policy turns into a restart that is not a failure.
- `verdict`: a `rerun_verdict` event, a log line, and the cycle marked as one that reached a
  verdict (`JobControl.settle_rerun`: the suspects that stood by for it count as standby nodes
  again, and a later request is a new re-run, not a repeat). A persistent error excludes the
  suspect node (it is standing by: it leaves with exit 5) and goes into the job's failure
  history; a correct result needs nothing more (with `fatal`, the ranks exit 17 and the policy
  stops the job); a transient error is only told.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ftrun.rendezvous.control import FailureRecord, JobControl, job_control
from ftrun.rendezvous.ranks import Round
from ftrun.rerun.verdicts import RerunFact, collect
from ftrun.services import NodeService, ServiceContext

log = logging.getLogger("ftrun.agent")

POLL_S = 0.2
"""How often the ranks' facts are read while they run (a directory listing)."""


class RerunService(NodeService):
    name = "rerun"

    def __init__(
        self, control: JobControl, job_dir: Path, node: str, emit: Callable[..., None]
    ) -> None:
        self._control, self._job_dir, self._node, self._emit = control, job_dir, node, emit
        self._cycle = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the poll thread and the final sweep

    def on_round(self, rnd: Round) -> None:
        self._cycle = rnd.number

    def on_started(self, rnd: Round, pids: Iterable[int]) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rerun-facts", daemon=True)
        self._thread.start()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self._last_sweep()

    def on_finished(self, rnd: Round) -> None:
        """A verdict the ranks wrote just before they finished still excludes its node."""
        self._last_sweep()

    def close(self) -> None:
        self._last_sweep()

    def sweep(self) -> None:
        """Act on every fact the ranks wrote since the last sweep."""
        with self._lock:
            for fact in collect(self._job_dir):
                if fact.kind == "suspect":
                    self._suspect(fact)
                elif fact.kind == "verdict":
                    self._verdict(fact)

    def _suspect(self, fact: RerunFact) -> None:
        log.error("rank %d's result at iteration %d (%s) reproduced in place: node %s steps "
                  "aside so that another node re-runs the step", fact.rank, fact.iteration,
                  fact.message, self._node)  # fmt: skip
        self._control.step_aside(self._node, self._cycle + 1)
        self._emit("rerun_suspect", rank=fact.rank, iteration=fact.iteration,
                   message=fact.message, result=fact.rerun)  # fmt: skip

    def _verdict(self, fact: RerunFact) -> None:
        suspect = fact.suspect_node or fact.node
        self._emit("rerun_verdict", diagnostic=fact.diagnostic, rank=fact.rank,
                   iteration=fact.iteration, message=fact.message, initial=fact.initial,
                   rerun=fact.rerun, suspect_node=suspect, fatal=fact.fatal)  # fmt: skip
        log.warning("re-run verdict for rank %d at iteration %d (%s): %s (first %s, re-run %s)",
                    fact.rank, fact.iteration, fact.message, fact.diagnostic, fact.initial,
                    fact.rerun)  # fmt: skip
        self._control.settle_rerun(self._cycle)
        if fact.diagnostic == "persistent_error":
            reason = (
                f"its result at iteration {fact.iteration} ({fact.message}) differed when re-run "
                f"on {fact.node}: a persistent error of this node's hardware"
            )
            self._control.mark_gone(suspect, reason)
            key = f"rerun: persistent error ({fact.message})"
            self._control.record_failure(FailureRecord(self._cycle, suspect, key))

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.sweep()
            except Exception:  # the store went away: the agent sees it and ends the cycle
                log.exception("reading the ranks' re-run facts failed")
                return

    def _last_sweep(self) -> None:
        """Stop polling, then act on what the ranks wrote since the last poll."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(POLL_S + 5.0)
            self._thread = None
        self.sweep()


def rerun_service(context: ServiceContext) -> RerunService:
    """The builder's factory (`ft_launcher.cli`)."""
    control = job_control(context.store, context.config.rendezvous.run_id)
    return RerunService(control, context.job_dir, context.node, context.emit)
