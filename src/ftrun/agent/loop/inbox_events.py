"""What an inbox item means to the policy while the workers run.

The agent's inbox (`inbox.py`) carries everything that happens to a running cycle: a worker's
exit, a hang verdict, a rank's control request, a health finding, a service's request, another
node ending the cycle, a signal. `InboxEvents` turns each into the policy's event, leaving on
the way what the cycle's report and the failure's evidence need (the exit's signature, the
hang's stacks). It decides nothing: `policy.Policy` does.
"""

from __future__ import annotations

import logging
import signal
import time

from ftrun.agent.decisions import policy as p
from ftrun.agent.decisions.policy import AgentEvent
from ftrun.agent.loop.evidence import Evidence
from ftrun.agent.loop.inbox import SignalReceived, take_until
from ftrun.agent.loop.reporting import CycleReport
from ftrun.agent.loop.runtime import AgentRuntime
from ftrun.agent.node_services.health_watch import HealthFinding
from ftrun.agent.node_services.neighbour_watch import NeighbourLost
from ftrun.agent.node_services.restart_watch import CycleEndedElsewhere
from ftrun.agent.workers import WorkerExited, WorkerGroup
from ftrun.rank_monitor import FirstProgress, Verdict, WorkloadControl
from ftrun.rank_monitor.protocol import InprocessNote
from ftrun.rendezvous.ranks import Round
from ftrun.services import ServiceRequest

log = logging.getLogger("ftrun.agent")

VERDICT_WINDOW_S = 0.05
"""How long after a hang verdict the agent takes the verdicts that follow it as one hang."""


class InboxEvents:
    """One node's translation of inbox items into policy events."""

    def __init__(self, runtime: AgentRuntime, report: CycleReport, evidence: Evidence) -> None:
        self.rt = runtime
        self.report = report
        self.evidence = evidence
        self._inbox = runtime.inbox

    def while_running(
        self, item: object, rnd: Round, group: WorkerGroup, running: set[int]
    ) -> AgentEvent | None:
        """The event `item` means while `group`'s workers (those in `running` not yet seen to
        exit) run round `rnd`; None for stale or unrelated items."""
        if isinstance(item, CycleEndedElsewhere):
            return self.ended_elsewhere(item.cycle) if item.cycle == rnd.number else None
        if isinstance(item, NeighbourLost):
            return p.NeighbourGone(item.node) if item.cycle == rnd.number else None
        if isinstance(item, WorkerExited) and item.pid in running:
            running.discard(item.pid)
            self.report.worker_exit(item)
            signature = self.evidence.of_exit(group, item)
            return p.WorkerEnded(item.rank, item.returncode, len(running), signature)
        if isinstance(item, Verdict) and item.worker_pid in running:
            return self._hangs(item, rnd, group)
        if isinstance(item, SignalReceived):
            return self.signalled(item)
        if isinstance(item, WorkloadControl) and item.worker_pid in running:
            return self._control(item)
        if isinstance(item, HealthFinding):
            return p.HealthFound(item.signature, item.fault)
        if isinstance(item, ServiceRequest):
            log.warning("the %s asks for %s: %s", item.service, item.action.name, item.reason)
            return p.ControlRequested(-1, item.action, item.reason, by=f"the {item.service}")
        if isinstance(item, FirstProgress):
            self.report.first_progress(item)
        if isinstance(item, InprocessNote):
            self.rt.inprocess.take(item, rnd.number)
        return None

    def ended_elsewhere(self, cycle: int) -> p.CycleEnded:
        log.info("cycle %d ended elsewhere: %s", cycle, self.rt.control.cause_of(cycle))
        return p.CycleEnded()

    def signalled(self, item: SignalReceived) -> p.Signalled:
        self.rt.events.emit("signal", signal=signal.Signals(item.signum).name)
        return p.Signalled(item.signum)

    def _hangs(self, first: Verdict, rnd: Round, group: WorkerGroup) -> p.HangsFound:
        """Batch the verdicts of one hang: ranks blocked behind the hung one are judged ms
        later, and every rank judged hung is killed at once and recorded. The window waits on
        the inbox for them (what else arrives meanwhile stays queued, in order)."""
        queued = take_until(self._inbox, Verdict, time.monotonic() + VERDICT_WINDOW_S)
        current = set(group.pids)
        verdicts = [first, *(v for v in queued if v.worker_pid in current)]
        for verdict in verdicts:
            self.report.hang(verdict, rnd)
        signature = self.evidence.of_hang(verdicts, rnd, group)
        return p.HangsFound(
            tuple(v.rank for v in verdicts), tuple(v.worker_pid for v in verdicts),
            first.kind.value, signature, any(v.stopped for v in verdicts),
        )  # fmt: skip

    def _control(self, item: WorkloadControl) -> p.ControlRequested:
        action = item.action.name
        self.rt.events.emit("control_request", rank=item.rank, action=action,
                            description=item.description)  # fmt: skip
        log.warning("rank %d asked for %s: %s", item.rank, action, item.description)
        return p.ControlRequested(item.rank, item.action, item.description)
