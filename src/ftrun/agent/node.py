"""NodeAgent: one per node; runs the lifecycle in `state.py` until the job ends.

Everything that happens to a running cycle arrives on one queue: worker exits (from watcher
threads), hang verdicts (from the RankMonitorServer thread) and signals (from handlers that
only enqueue). The main loop takes them one at a time; between them, every `monitor_interval`,
it asks the store whether another node ended the cycle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import signal
import time
from pathlib import Path

from torch.distributed import DistError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)

from ftrun.agent.reporting import CycleReport
from ftrun.agent.runtime import AgentRuntime
from ftrun.agent.state import AgentState, check_transition
from ftrun.agent.termination import become_subreaper, stop_process_groups
from ftrun.agent.workers import WorkerExited, WorkerGroup, worker_env
from ftrun.errors import ExitCode, FtrunError, NodeUnhealthyError
from ftrun.rank_monitor import Verdict
from ftrun.rendezvous.barrier import JoinInterruptedError
from ftrun.rendezvous.ranks import Round

log = logging.getLogger("ftrun.agent")

_SCALE_CHECK_S = 1.0
# Peers need the store only to read why the job ends (they poll every monitor interval, or
# every second while joining): a few seconds cover them, a dead peer must not hold us long.
_STORE_LINGER_S = 5.0
_VERDICT_WINDOW_S = 0.05


@dataclasses.dataclass(frozen=True)
class SignalReceived:
    signum: int


class NodeAgent:
    """Runs the local workers of every cycle of one job on this node."""

    def __init__(self, runtime: AgentRuntime) -> None:
        self.rt = runtime
        self.cfg = runtime.config.agent
        self.events = runtime.events
        self.report = CycleReport(runtime)
        self._inbox: queue.SimpleQueue[object] = runtime.inbox
        self.state = AgentState.HEALTH_CHECK
        self._round: Round | None = None
        self._group: WorkerGroup | None = None
        self._exit_code = ExitCode.FAILED
        self._then_exit: ExitCode | None = None
        """Set when stopping: exit with this code afterwards; None means restart."""
        self._stop_signal = self.cfg.termination_signal
        self._signalled: int | None = None
        self._handlers = {
            AgentState.HEALTH_CHECK: self._health_check,
            AgentState.RENDEZVOUS: self._rendezvous,
            AgentState.STARTING: self._start,
            AgentState.RUNNING: self._monitor,
            AgentState.STOPPING: self._stop,
            AgentState.SUCCEEDED: self._await_others,
            AgentState.EXITING: self._exit,
        }

    def run(self) -> ExitCode:
        for sig in self.cfg.signals_to_handle:
            signal.signal(sig, self._on_signal)
        become_subreaper()
        try:
            while self.state is not AgentState.EXITED:
                try:
                    next_state = self._handlers[self.state]()
                except DistError as exc:  # the store's host node died, or its network did
                    next_state = self._store_lost(exc)
                self.state = check_transition(self.state, next_state)
        finally:
            if self._group is not None:  # only on a bug: never leave workers behind
                self._stop_workers()
        self.events.emit("exit", code=int(self._exit_code), reason=self._exit_code.name)
        return self._exit_code

    # ---- signals: handlers only record and enqueue -------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signalled = signum
        self._inbox.put(SignalReceived(signum))

    # ---- states --------------------------------------------------------------------------

    def _health_check(self) -> AgentState:
        try:
            self.rt.check_health()
        except NodeUnhealthyError as exc:
            self.events.emit("unhealthy", reason=str(exc))
            self.rt.control.report_unhealthy(self.rt.control.cycle(), self.rt.node, str(exc))
            return self._exit_with(exc.exit_code, f"node unhealthy: {exc}")
        return AgentState.RENDEZVOUS

    def _rendezvous(self) -> AgentState:
        control = self.rt.control
        shutdown = control.shutdown_requested()
        if shutdown is not None:
            return self._exit_with(shutdown.code, shutdown.reason)
        failures = control.failures()
        if failures > self.cfg.max_restarts:
            budget = self.cfg.max_restarts
            reason = f"restart budget spent ({failures} failures, --max-restarts={budget})"
            control.shutdown(ExitCode.FAILED, reason, control.cycle())
            return self._exit_with(ExitCode.FAILED, reason)
        started = time.monotonic()
        try:
            self._round = self.rt.rendezvous.join(lambda: self._signalled is not None)
        except JoinInterruptedError:
            return self._preempt_before_start()
        except RendezvousClosedError:
            shutdown = control.shutdown_requested()
            code, reason = (
                (shutdown.code, shutdown.reason) if shutdown else (ExitCode.FAILED, "closed")
            )
            return self._exit_with(code, reason)
        except (RendezvousTimeoutError, RendezvousError) as exc:
            return self._exit_with(ExitCode.FAILED, f"rendezvous failed: {exc}")
        except FtrunError as exc:
            return self._exit_with(exc.exit_code, str(exc))
        rnd = self._round
        self.events.cycle = rnd.number
        self.events.emit(
            "rendezvous_done",
            duration=round(time.monotonic() - started, 6),
            group_rank=rnd.group_rank,
            nodes=[n.node for n in rnd.nodes],
            world_size=rnd.world_size,
            store_host=self.rt.is_store_host,
        )
        log.info(
            "cycle %d: group rank %d of %d nodes, world size %d",
            rnd.number,
            rnd.group_rank,
            len(rnd.nodes),
            rnd.world_size,
        )
        return AgentState.STARTING

    def _start(self) -> AgentState:
        rnd = self._round
        assert rnd is not None
        cycle_dir = self.rt.node_log_dir / f"cycle{rnd.number}"
        group = WorkerGroup(self.cfg, self._inbox)
        self._group = group
        first = rnd.first_global_rank
        envs = [
            worker_env(
                self.rt.base_worker_env(rnd), self._error_file(cycle_dir, first + i), i, first + i
            )
            for i in range(rnd.me.local_world_size)
        ]
        try:
            group.start(first, envs, cycle_dir, self.rt.spares, self.rt.monitor.expect_rank)
        except OSError as exc:
            self._then_exit = None
            self.rt.control.request_restart(rnd.number, f"spawn failed on {self.rt.node}: {exc}")
            return AgentState.STOPPING
        self.events.emit("workers_started", ranks=[w.rank for w in group.workers], pids=group.pids)
        return AgentState.RUNNING

    def _monitor(self) -> AgentState:
        rnd, group = self._round, self._group
        assert rnd is not None and group is not None
        running = {w.proc.pid for w in group.workers}
        next_scale_check = time.monotonic() + _SCALE_CHECK_S
        spares_due = time.monotonic() + self.cfg.spare_delay
        while True:
            try:
                item = self._inbox.get(timeout=self.cfg.monitor_interval)
            except queue.Empty:
                item = None
            if item is not None:
                next_state = self._on_item(item, running)
            elif self.rt.control.restart_requested(rnd.number):
                next_state = self._follow_restart(rnd.number)
            else:
                next_state = None
                spares_due = self._fill_spares_when_due(rnd, group, spares_due)
                if time.monotonic() >= next_scale_check:
                    next_scale_check = time.monotonic() + _SCALE_CHECK_S
                    self._maybe_scale_up(rnd)
            if next_state is not None:
                return next_state

    def _fill_spares_when_due(self, rnd: Round, group: WorkerGroup, due: float) -> float:
        """Start the next cycle's spares once every local rank is past its start-up (or at
        `due`); returns the next due time (never again this cycle once filled)."""
        if self.rt.spares is None or due == float("inf"):
            return due
        ranks = {w.rank for w in group.workers}
        if time.monotonic() < due and not ranks <= self.rt.monitor.progressing_ranks():
            return due
        self.rt.spares.fill(rnd.me.local_world_size)
        return float("inf")

    def _store_lost(self, error: DistError) -> AgentState:
        first_line = (str(error).strip().splitlines() or [repr(error)])[0]
        log.error("lost the rendezvous store: %s", first_line)
        self.events.emit("store_lost", error=first_line)
        if self._group is not None:
            self._then_exit, self._exit_reason = ExitCode.FAILED, "rendezvous store lost"
            return AgentState.STOPPING
        return self._exit_with(ExitCode.FAILED, "rendezvous store lost")

    def _on_item(self, item: object, running: set[int]) -> AgentState | None:
        """React to one inbox item while workers run; None means keep watching."""
        if isinstance(item, WorkerExited) and item.pid in running:
            running.discard(item.pid)
            self.report.worker_exit(item)
            if item.returncode != 0:
                return self._fail(
                    f"rank {item.rank} on {self.rt.node} {_exit_text(item.returncode)}"
                )
            return None if running else AgentState.SUCCEEDED
        if isinstance(item, Verdict) and item.worker_pid in running:
            return self._handle_hangs(item)
        if isinstance(item, SignalReceived):
            return self._preempt(item.signum)
        return None

    def _stop(self) -> AgentState:
        pids = self._group.pids if self._group else []
        result = self._stop_workers()
        self.events.emit(
            "stop_done",
            duration=round(result.duration, 6),
            killed=result.killed,
            survivors=result.survivors,
        )
        if self._then_exit is not None:
            return self._exit_with(self._then_exit, self._exit_reason or self._then_exit.name)
        self.report.gpu_memory_reclaim(pids)
        self.events.emit("restart")
        return AgentState.HEALTH_CHECK

    def _await_others(self) -> AgentState:
        rnd = self._round
        assert rnd is not None
        self._group = None
        control = self.rt.control
        control.arrive(rnd.number, "succeeded")
        deadline = time.monotonic() + self.cfg.exit_barrier_timeout
        while control.count(rnd.number, "succeeded") < len(rnd.nodes):
            if control.restart_requested(rnd.number):
                shutdown = control.shutdown_requested()
                if shutdown is not None:
                    return self._exit_with(shutdown.code, shutdown.reason)
                self.events.emit("restart", cause="another node failed after this one finished")
                return AgentState.HEALTH_CHECK
            if time.monotonic() >= deadline:
                break
            time.sleep(self.cfg.monitor_interval)  # polled: c10d logs every timed-out wait
        return self._exit_with(ExitCode.SUCCESS, "all workers finished")

    def _exit(self) -> AgentState:
        self.rt.leave(self._round, _STORE_LINGER_S)
        return AgentState.EXITED

    # ---- helpers -------------------------------------------------------------------------

    _exit_reason: str | None = None

    def _exit_with(self, code: ExitCode, reason: str) -> AgentState:
        self._exit_code = code
        self._exit_reason = reason
        level = logging.INFO if code is ExitCode.SUCCESS else logging.ERROR
        log.log(level, "exiting with %d (%s): %s", int(code), code.name, reason)
        return AgentState.EXITING

    def _fail(self, cause: str) -> AgentState:
        rnd = self._round
        assert rnd is not None
        log.error("cycle %d failed: %s", rnd.number, cause)
        self.rt.control.request_restart(rnd.number, cause)
        self._then_exit = None
        return AgentState.STOPPING

    def _follow_restart(self, cycle: int) -> AgentState:
        shutdown = self.rt.control.shutdown_requested()
        if shutdown is not None:
            self._then_exit, self._exit_reason = shutdown.code, shutdown.reason
            if shutdown.code is ExitCode.PREEMPTED:
                self._stop_signal = self.cfg.termination_signal
        else:
            self._then_exit = None
            log.info("cycle %d ended elsewhere: %s", cycle, self.rt.control.restart_cause(cycle))
        return AgentState.STOPPING

    def _preempt(self, signum: int) -> AgentState:
        rnd = self._round
        assert rnd is not None
        name = signal.Signals(signum).name
        reason = f"{name} on node {self.rt.node}"
        self.events.emit("signal", signal=name)
        shutdown = self.rt.control.shutdown(ExitCode.PREEMPTED, reason, rnd.number)
        self._then_exit, self._exit_reason = shutdown.code, shutdown.reason
        self._stop_signal = signal.Signals(signum)  # forwarded: workers may checkpoint
        return AgentState.STOPPING

    def _preempt_before_start(self) -> AgentState:
        signum = self._signalled or signal.SIGTERM
        reason = f"{signal.Signals(signum).name} on node {self.rt.node}"
        self.rt.control.shutdown(ExitCode.PREEMPTED, reason, self.rt.control.cycle())
        return self._exit_with(ExitCode.PREEMPTED, reason)

    def _maybe_scale_up(self, rnd: Round) -> None:
        max_nodes = self.rt.config.rendezvous.max_nodes
        if len(rnd.nodes) < max_nodes and self.rt.rendezvous.num_nodes_waiting() > 0:
            self.rt.control.request_restart(rnd.number, "a new node is waiting", failure=False)

    def _stop_workers(self):
        group = self._group
        self._group = None
        assert group is not None
        spares = frozenset(self.rt.spares.pids) if self.rt.spares else frozenset()
        result = stop_process_groups(
            group.pids, self._stop_signal, self.cfg.workers_stop_timeout, keep=spares
        )
        group.join_threads()
        self.rt.monitor.forget_all()
        self._drain_stale()
        return result

    def _drain_stale(self) -> None:
        """Drop exits and verdicts of stopped workers; keep signals."""
        for item in self._take_queued(object):
            if isinstance(item, SignalReceived):
                self._inbox.put(item)

    def _handle_hangs(self, first: Verdict) -> AgentState:
        """Kill every rank judged hung in this batch at once (a hung rank cannot be asked to
        stop, and its stacks are already captured), record each, then fail the cycle."""
        time.sleep(_VERDICT_WINDOW_S)  # ranks blocked behind the hung one are judged ms later
        current = set(self._group.pids) if self._group else set()
        verdicts = [first, *(v for v in self._take_queued(Verdict) if v.worker_pid in current)]
        for verdict in verdicts:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(verdict.worker_pid, signal.SIGKILL)
            self.report.hang(verdict, self._round)
        ranks = ", ".join(str(v.rank) for v in verdicts)
        return self._fail(f"rank(s) {ranks} on {self.rt.node} hung ({first.kind.value})")

    def _take_queued(self, kind: type) -> list:
        """Remove and return queued items of `kind`, keeping the rest in order."""
        taken, kept = [], []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            (taken if isinstance(item, kind) else kept).append(item)
        for item in kept:
            self._inbox.put(item)
        return taken

    @staticmethod
    def _error_file(cycle_dir: Path, rank: int) -> dict[str, str]:
        return {"TORCHELASTIC_ERROR_FILE": str(cycle_dir / f"rank{rank}" / "error.json")}


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
