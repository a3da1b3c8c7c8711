"""NodeAgent: executes the decisions of `policy.Policy`, one state at a time.

Each state has a step that observes (runs the health checks, joins the round, starts or stops
the workers, or takes the next inbox item) and turns what it saw into an event; the policy
decides; `_apply` carries the action out (store writes, signals, the next state). The agent
decides nothing itself. Everything that happens to a running cycle arrives on the inbox (see
`inbox.py`; `inbox_events.py` says what each item means to the policy), another node ending
the cycle too (`RestartWatch` waits on its key); every `_RESTART_CHECK_S` the agent also asks
the store itself, in case that watch lost its store.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import time

from torch.distributed import DistError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)

from ftrun.agent.decisions import policy as p
from ftrun.agent.decisions.observed import RungFailed
from ftrun.agent.decisions.policy import Action, AgentEvent, Outcome, Policy
from ftrun.agent.decisions.state import AgentState, check_transition
from ftrun.agent.loop.evidence import Evidence
from ftrun.agent.loop.facts import read_facts
from ftrun.agent.loop.inbox import SignalReceived, SignalRecorder, take_queued
from ftrun.agent.loop.inbox_events import InboxEvents
from ftrun.agent.loop.inprocess_effects import carry_out
from ftrun.agent.loop.reporting import CycleReport
from ftrun.agent.loop.runtime import AgentRuntime
from ftrun.agent.termination import PROCESSES, Delivery, StopResult, Termination, become_subreaper
from ftrun.agent.worker_env import worker_envs
from ftrun.agent.workers import WorkerGroup
from ftrun.errors import ExitCode, FtrunError, NodeUnhealthyError
from ftrun.rank_monitor import ProgressSnapshot
from ftrun.rendezvous.control import FailureRecord
from ftrun.rendezvous.errors import JoinInterruptedError
from ftrun.rendezvous.ranks import Round
from ftrun.store.reconnecting import StoreRestartedError

log = logging.getLogger("ftrun.agent")

_SCALE_CHECK_S = 1.0
_RESTART_CHECK_S = 2.0
"""How often the agent itself checks the cycle's restart key while its workers run: a safety
net only (`RestartWatch` waits on it and tells the inbox at once)."""
# Peers need the store only to read why the job ends (they poll every monitor interval, or
# every second while joining): a few seconds cover them, a dead peer must not hold us long.
_STORE_LINGER_S = 5.0


class NodeAgent:
    """Runs the local workers of every cycle of one job on this node."""

    def __init__(
        self, runtime: AgentRuntime, signals: SignalRecorder, termination: Termination = PROCESSES
    ) -> None:
        """`termination`: how workers are stopped (a fake in tests that run no process)."""
        self.rt = runtime
        self._termination = termination
        self.cfg = runtime.config.agent
        self.events = runtime.events
        self.report = CycleReport(runtime)
        self.evidence = Evidence(runtime)
        self._inbox_events = InboxEvents(runtime, self.report, self.evidence)
        self.policy = Policy(
            self.cfg.max_restarts, self.cfg.max_no_progress_cycles, self.cfg.max_same_failure,
            self.cfg.health_action, self.cfg.attribution_stop_action,
        )  # fmt: skip
        self.state = AgentState.HEALTH_CHECK
        self._inbox = runtime.inbox
        self._signals = signals
        self._round: Round | None = None
        self._group: WorkerGroup | None = None
        self._after_stop: Outcome | None = None
        self._stop_signal, self._drain = self.cfg.termination_signal, False
        self._outcome = Outcome(ExitCode.FAILED, "the agent ended without a decision (a bug)")
        self._steps = {
            AgentState.HEALTH_CHECK: self._health_check,
            AgentState.RENDEZVOUS: self._rendezvous,
            AgentState.STARTING: self._start,
            AgentState.RUNNING: self._watch,
            AgentState.STOPPING: self._stop,
            AgentState.SUCCEEDED: self._await_others,
        }

    def run(self) -> ExitCode:
        become_subreaper()
        try:
            while self.state is not AgentState.EXITING:
                try:
                    action = self._steps[self.state]()
                except StoreRestartedError as exc:  # `ftrun store` came back empty
                    action = self._store_restarted(exc)
                except DistError as exc:  # the store's host node died, or its network did
                    action = self._store_lost(exc)
                self._apply(action)
            self.rt.leave(self._round, _STORE_LINGER_S)
            self.state = check_transition(self.state, AgentState.EXITED)
        finally:
            if self._group is not None:  # only on a bug: never leave workers behind
                self._stop_workers()
        code = self._outcome.code
        self.events.emit("exit", code=int(code), reason=code.name, why=self._outcome.reason)
        return code

    # ---- deciding and applying -------------------------------------------------------------

    def _decide(self, event: AgentEvent) -> Action:
        facts = read_facts(self.rt, event, self._round, self._after_stop)
        return self.policy.decide(self.state, event, facts)

    def _apply(self, action: Action) -> None:
        control, outcome = self.rt.control, action.outcome
        if action.record is not None and self._round is not None:
            self.report.failure(action.record, *action.decision())
            if not action.record.secondary:
                record = FailureRecord(self._round.number, self.rt.node, action.record.key,
                                       self._round.ranks_of(self.rt.node))  # fmt: skip
                control.record_failure(record)
        if action.note is not None:
            log.warning("%s", action.note)
        if action.report_unhealthy is not None:
            self.events.emit("unhealthy", reason=action.report_unhealthy)
            control.report_unhealthy(control.cycle(), self.rt.node, action.report_unhealthy)
        if action.leave is not None:
            control.mark_gone(self.rt.node, action.leave)
        for pid in action.kill:  # hung ranks: their stacks are taken, nothing to wait for
            self._termination.kill_now(pid)
        if (vote := action.vote) is not None and self._round is not None:
            if vote.failure:
                log.error("cycle %d failed: %s", self._round.number, vote.cause)
            control.request_restart(self._round.number, vote.cause, vote.failure, vote.rerun)
        if action.shutdown is not None:
            cycle = self._round.number if self._round else control.cycle()
            in_force = control.shutdown(action.shutdown.code, action.shutdown.reason, cycle)
            outcome = Outcome(in_force.code, in_force.reason)
        self._stop_signal = action.stop_signal or self._stop_signal
        self._drain = self._drain or action.drain
        self._enter(action.next_state, outcome)

    def _enter(self, next_state: AgentState | None, outcome: Outcome | None) -> None:
        if next_state is AgentState.STOPPING or (
            next_state is None and self.state is AgentState.STOPPING and outcome is not None
        ):
            self._after_stop = outcome
        if next_state is AgentState.EXITING:
            assert outcome is not None, "the policy exits with an outcome"
            self._outcome = outcome
            level = logging.INFO if outcome.code is ExitCode.SUCCESS else logging.ERROR
            log.log(level, "exiting with %d (%s): %s", outcome.code, outcome.code.name,
                    outcome.reason)  # fmt: skip
        if next_state is not None:
            self.state = check_transition(self.state, next_state)

    # ---- steps: observe, then ask ----------------------------------------------------------

    def _health_check(self) -> Action:
        if (signalled := self._pending_signal()) is not None:
            return self._decide(signalled)
        try:
            self.rt.services.before_round()
        except NodeUnhealthyError as exc:
            return self._decide(p.HealthChecked(str(exc), exc.exit_code))
        return self._decide(p.HealthChecked())

    def _rendezvous(self) -> Action:
        before = self._decide(p.JoinReady())
        if before.next_state is not None:
            return before
        started = time.monotonic()
        try:
            rnd = self.rt.rendezvous.join(lambda: self._signals.last is not None)
        except JoinInterruptedError:
            return self._decide(p.Signalled(self._signals.last or signal.SIGTERM))
        except RendezvousClosedError:
            return self._decide(p.JoinFailed("rendezvous closed", closed=True))
        except (RendezvousTimeoutError, RendezvousError) as exc:
            return self._decide(p.JoinFailed(f"rendezvous failed: {exc}"))
        except FtrunError as exc:
            return self._decide(p.JoinFailed(str(exc), exc.exit_code))
        before, self._round = self._round, rnd
        self.events.cycle = rnd.number
        # A standby node arrived again when the cycle it waited through ended.
        if rnd.arrived_at is not None:
            started = max(started, rnd.arrived_at)
        self.events.emit(
            "rendezvous_done", duration=round(time.monotonic() - started, 6),
            group_rank=rnd.group_rank, nodes=[n.node for n in rnd.nodes],
            world_size=rnd.world_size, store_host=self.rt.is_store_host,
            standby=list(rnd.standby), stalled_cycles=rnd.stalled_cycles,
        )  # fmt: skip
        log.info("cycle %d: group rank %d of %d nodes, world size %d",
                 rnd.number, rnd.group_rank, len(rnd.nodes), rnd.world_size)  # fmt: skip
        self.evidence.lost_nodes(before, rnd)
        return self._decide(p.Joined())

    def _start(self) -> Action:
        rnd = self._round
        assert rnd is not None
        self.rt.services.on_round(rnd)
        cycle_dir = self.rt.node_log_dir / f"cycle{rnd.number}"
        envs = worker_envs(
            self.rt.config, self.rt.environ, self.rt.services.worker_env(rnd), rnd,
            self.rt.node, cycle_dir,
        )  # fmt: skip
        self._group = WorkerGroup(self.cfg, self._inbox)
        spawn_began = time.monotonic()
        try:
            self._group.start(rnd.first_global_rank, envs, cycle_dir, self.rt.spawner,
                              self.rt.monitor.expect_rank)  # fmt: skip
        except (OSError, FtrunError) as exc:
            return self._decide(p.SpawnFailed(str(exc)))
        group = self._group
        ranks = [w.rank for w in group.workers]
        how = self.rt.spawner.cycle_path()
        self.events.emit("workers_started", ranks=ranks, pids=group.pids, path=how.path,
                         why=how.why)  # fmt: skip
        log.info("cycle %d: workers %s%s", rnd.number, how.path,
                 f" ({how.why})" if how.why else "")  # fmt: skip
        self.report.expect_progress(ranks, group.pids, spawn_began)
        self.rt.services.on_started(rnd, group.pids)
        return self._decide(p.WorkersStarted())

    def _watch(self) -> Action:
        rnd, group = self._round, self._group
        assert rnd is not None and group is not None
        running = set(group.pids)
        next_scale_check = time.monotonic() + _SCALE_CHECK_S
        next_restart_check = time.monotonic() + _RESTART_CHECK_S
        while True:
            try:
                item = self._inbox.get(timeout=self.cfg.monitor_interval)
            except queue.Empty:
                item = None
            event: AgentEvent | None = None
            if item is not None:
                event = self._inbox_events.while_running(item, rnd, group, running)
            elif time.monotonic() >= next_restart_check:  # the restart watch's safety net
                next_restart_check = time.monotonic() + _RESTART_CHECK_S
                if self.rt.control.restart_requested(rnd.number):
                    event = self._inbox_events.ended_elsewhere(rnd.number)
            elif time.monotonic() >= next_scale_check:
                next_scale_check = time.monotonic() + _SCALE_CHECK_S
                if len(rnd.nodes) < self.rt.config.rendezvous.max_nodes:
                    event = p.NodesWaiting(self.rt.rendezvous.num_nodes_waiting())
            if event is None:
                continue
            action = self._decide(event)
            if action.interrupt is not None or action.replace is not None:
                # The ladder's in-process rungs are effects that can fail (unreachable ranks,
                # a worker that cannot start): the failure is an event, decided again.
                failed = carry_out(action, rnd, group, self.rt)
                if failed is not None:
                    assert isinstance(event, (p.WorkerEnded, p.HangsFound))
                    action = self._decide(RungFailed(event, failed))
                elif action.replace is not None:  # a lost rank's process started again
                    index = action.replace.rank - rnd.first_global_rank
                    running.add(group.workers[index].proc.pid)
            if action.next_state is not None:
                return action
            self._apply(action)  # effects without a move (a scale-up vote)

    def _stop(self) -> Action:
        pids = self._group.pids if self._group else []
        self._note_progress("stop")
        self.evidence.before_stop(self._round, self._group)
        # None: stopped already, when the store restarted during this step and it runs again.
        result = self._stop_workers() if self._group is not None else StopResult(0.0, 0, 0)
        self.evidence.after_stop(self._round)
        self.events.emit("stop_done", duration=round(result.duration, 6), killed=result.killed,
                         survivors=result.survivors, stopped=result.stopped)  # fmt: skip
        self._stop_signal, self._drain = self.cfg.termination_signal, False
        if self._after_stop is None:
            self.rt.services.on_stopped(self._round, pids)
            self.events.emit("restart")
        return self._decide(p.WorkersStopped())

    def _await_others(self) -> Action:
        """Wait (bounded) until every node of the round finished, watching for a late restart
        elsewhere and for signals (preemption after success still exits 75)."""
        rnd = self._round
        assert rnd is not None
        self._group = None
        self._note_progress("finished")
        self.rt.services.on_finished(rnd)
        control = self.rt.control
        control.arrive(rnd.number, "succeeded")
        deadline = time.monotonic() + self.cfg.exit_barrier_timeout
        while (finished := control.count(rnd.number, "succeeded")) < len(rnd.nodes):
            if control.restart_requested(rnd.number):
                action = self._decide(p.CycleEnded())
                if action.next_state is AgentState.HEALTH_CHECK:
                    self.events.emit("restart", cause="another node failed after this one finished")
                return action
            if time.monotonic() >= deadline:
                break
            # Polled (c10d logs every timed-out wait); the inbox wait doubles as the sleep.
            with contextlib.suppress(queue.Empty):
                item = self._inbox.get(timeout=self.cfg.monitor_interval)
                if isinstance(item, SignalReceived):
                    return self._decide(self._inbox_events.signalled(item))
        return self._decide(p.PeersFinished(all_finished=finished >= len(rnd.nodes)))

    # ---- helpers -------------------------------------------------------------------------

    def _note_progress(self, before: str) -> None:
        """Report where the ranks got to: in the events, and to the job's progress record
        (best effort: the store may be what failed)."""
        snapshot = self.rt.monitor.progress_snapshot()
        self.report.last_progress(snapshot, before=before)
        if self._round is not None:
            with contextlib.suppress(DistError, RuntimeError):
                self.rt.control.report_progress(
                    self._round.number, self.rt.node, highest_iteration(snapshot)
                )

    def _pending_signal(self) -> p.Signalled | None:
        received = take_queued(self._inbox, SignalReceived)
        return self._inbox_events.signalled(received[0]) if received else None

    def _store_lost(self, error: DistError) -> Action:
        first_line = (str(error).strip().splitlines() or [repr(error)])[0]
        log.error("lost the rendezvous store: %s", first_line)
        self.events.emit("store_lost", error=first_line)
        return self._decide(p.StoreLost(first_line))  # decided without the store

    def _store_restarted(self, restarted: StoreRestartedError) -> Action:
        self.events.emit("store_restarted")
        cycle = self._round.number if self._round else -1
        restarted.store.rebuild(lambda: self.rt.restore_job_state(cycle))
        return self._decide(p.StoreRestarted())

    def _stop_workers(self) -> StopResult:
        group = self._group
        self._group = None
        assert group is not None
        delivery = Delivery.graceful(self._stop_signal, self.cfg.workers_stop_timeout, self._drain)
        result = self._termination.terminate(group.pids, delivery, self.rt.services.kept_pids())
        group.join_threads()
        self.rt.monitor.forget_all()
        # Exits, verdicts and notes of the stopped workers are stale; signals are not.
        for item in take_queued(self._inbox, object):
            if isinstance(item, SignalReceived):
                self._inbox.put(item)
        return result


def highest_iteration(snapshot: list[ProgressSnapshot]) -> int | None:
    """The highest iteration any local rank reported this cycle; None if none did."""
    return max((r.last_iteration for r in snapshot if r.last_iteration is not None), default=None)
