"""The evidence a node gathers about a failure, before and after the policy decides: what the
executor (`node.NodeAgent`) reads and writes about failures, kept apart from its loop.

Before the decision: the failed rank's stderr tail named as a signature; a hang's verdicts
reduced to one signature (a stopped rank, else the rank stuck in its own code, else a
consequence of whoever the others wait for), with the flight recorders dumped before the hung
ranks are killed.
Around the stop: every node's flight-recorder summaries, and the collective a rank never
entered, blamed on that rank's node in the job's history. At the next round: the nodes of the
previous one that vanished with their workers (`node_lost`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from torch.distributed import DistError

from ftrun.agent.decisions.attribution import (
    STDERR_TAIL_BYTES,
    Signature,
    collective_signature,
    exit_signature,
    hang_cause,
    hang_signature,
)
from ftrun.agent.loop.flight_recorder import FlightRecorder, suspect_nodes
from ftrun.agent.loop.runtime import AgentRuntime
from ftrun.agent.workers import WorkerExited, WorkerGroup
from ftrun.errors import ExitCode
from ftrun.rank_monitor import Verdict
from ftrun.rendezvous.control import FailureRecord
from ftrun.rendezvous.ranks import Round

log = logging.getLogger("ftrun.agent")

_NOT_FAILURES = (0, ExitCode.RESUME_TO_DISAMBIGUATE, ExitCode.FAILED_ON_RESULT_VALIDATION)
"""Exits the re-run state machine asks for: decisions, not failures to name."""


class Evidence:
    """One node's failure evidence across its cycles."""

    def __init__(self, runtime: AgentRuntime) -> None:
        self.rt = runtime
        self._flight = FlightRecorder(runtime.job_dir, runtime.node_log_dir, runtime.node,
                                      runtime.events.emit)  # fmt: skip

    def of_exit(self, group: WorkerGroup | None, item: WorkerExited) -> Signature | None:
        """A worker's own failure, named from the end of its stderr; None for an exit 0."""
        if item.returncode in _NOT_FAILURES or group is None:
            return None
        tail = group.stderr_tail(item.pid, STDERR_TAIL_BYTES)
        return exit_signature(item.returncode, tail, item.rank)

    def of_hang(
        self, verdicts: Sequence[Verdict], rnd: Round | None, group: WorkerGroup | None
    ) -> Signature:
        """One signature for a hang's verdicts (`hang_cause`: a stopped rank's, else one stuck
        in its own code); the flight recorders are dumped (and every node asked to dump) before
        the hung ranks are killed."""
        if rnd is not None and group is not None:
            self._flight.on_hang(self.rt.control, rnd.number, _workers(group))
        return hang_cause([hang_signature(v.kind.value, v.section, v.stuck, v.rank, v.stopped)
                           for v in verdicts])  # fmt: skip

    def before_stop(self, rnd: Round | None, group: WorkerGroup | None) -> None:
        if rnd is not None and group is not None:
            with contextlib.suppress(DistError, RuntimeError):  # evidence, never a blocker
                self._flight.before_stop(self.rt.control, rnd.number, _workers(group))

    def after_stop(self, rnd: Round | None) -> None:
        """On the node that judged a hang: the nodes whose ranks never entered the stalled
        collective get the failure in the job's history (as if they had reported it)."""
        if rnd is None:
            return
        with contextlib.suppress(DistError, RuntimeError):
            for stall in self._flight.after_stop(self.rt.control, rnd):
                key = collective_signature(stall.op, stall.seq, list(stall.missing)).key
                for node in suspect_nodes(rnd, stall) if stall.missing else ():
                    record = FailureRecord(rnd.number, node, key, rnd.ranks_of(node))
                    self.rt.control.record_failure(record)

    def lost_nodes(self, before: Round | None, rnd: Round) -> None:
        """Nodes of the previous cycle that are gone without a word (their launcher died with
        their workers): the cause of that cycle's end, whatever failed on the others because of
        it. Told once, by the first node (in group-rank order) that was in both rounds."""
        if before is None or before.number != rnd.number - 1:
            return
        previous = {n.node for n in before.nodes}
        survivors = [n.node for n in rnd.nodes if n.node in previous]
        if not survivors or survivors[0] != self.rt.node:
            return
        present = {n.node for n in rnd.nodes} | set(rnd.standby)
        lost = [n.node for n in before.nodes if n.node not in present
                and not self.rt.control.left_on_purpose(n.node, before.number)]  # fmt: skip
        if lost:
            log.error("cycle %d ended because node(s) %s were lost (launcher and workers gone)",
                      before.number, ", ".join(lost))  # fmt: skip
            self.rt.events.emit("node_lost", nodes=lost, lost_cycle=before.number)


def _workers(group: WorkerGroup) -> list[tuple[int, int]]:
    """(rank, pid) of a cycle's local workers."""
    return [(w.rank, w.proc.pid) for w in group.workers]
