"""The agent loop with no process (`agent_harness`): the real NodeAgent, policy, rendezvous on
a HashStore, rank monitor and events; fake workers whose exits the test decides, and a fake
termination. Each test checks one decision the launcher tests used to check with processes."""

from __future__ import annotations

import queue
import signal
import threading
import time
from pathlib import Path

from agent_harness import FakeWorker, running_agent
from ftrun.agent.loop.inbox import take_until
from ftrun.agent.node_services.neighbour_watch import NeighbourLost
from ftrun.errors import ExitCode
from ftrun.rank_monitor import HangKind, Verdict, WorkloadAction, WorkloadControl
from ftrun.services import ServiceRequest
from support import wait_for


def test_workers_that_finish_end_the_job_with_success(tmp_path: Path) -> None:
    with running_agent(tmp_path) as node:
        for worker in node.spawner.started(2):
            worker.exit(0)
        assert node.result() == ExitCode.SUCCESS
    assert [e["code"] for e in node.events("exit")] == [0]


def test_a_crash_restarts_the_cycle_then_the_budget_ends_the_job(tmp_path: Path) -> None:
    with running_agent(tmp_path, ["--max-restarts=1"]) as node:
        first = node.spawner.started(2)
        first[1].exit(1)  # the other worker is stopped by the agent
        second = node.spawner.started(4)[2:]
        assert [w.rank for w in second] == [0, 1]
        assert node.termination.stops[0][1].first == signal.SIGTERM
        second[0].exit(1)
        assert node.result() == ExitCode.FAILED
    assert len(node.events("workers_started")) == 2


def test_a_signal_stops_the_workers_and_exits_preempted(tmp_path: Path) -> None:
    with running_agent(tmp_path, ["--max-restarts=3"]) as node:
        node.spawner.started(2)
        node.signal(signal.SIGTERM)
        assert node.result() == ExitCode.PREEMPTED
    assert len(node.termination.stops) == 1 and len(node.spawner.workers) == 2


def test_a_hung_rank_is_killed_at_once_and_the_cycle_restarts(tmp_path: Path) -> None:
    with running_agent(tmp_path, ["--max-restarts=1"]) as node:
        workers = node.spawner.started(2)
        monitor = node.runtime.monitor
        wait_for(lambda: monitor._ranks.expected.get(1) == workers[1].pid, 5, "rank 1 expected")
        node.post(_verdict(workers[1]))
        node.spawner.started(4)
        assert node.termination.killed == [workers[1].pid]
        for worker in node.spawner.workers[2:]:
            worker.exit(0)
        assert node.result() == ExitCode.SUCCESS


def test_verdicts_of_one_hang_are_taken_together_and_a_signal_between_them_waits(
    tmp_path: Path,
) -> None:
    """The verdict window drains the inbox (no sleep): both ranks are one hang, killed at once;
    the signal that came between them is handled after, in order (the job is preempted)."""
    with running_agent(tmp_path, ["--max-restarts=3"]) as node:
        workers = node.spawner.started(2)
        monitor = node.runtime.monitor
        for worker in workers:
            wait_for(lambda w=worker: monitor._ranks.expected.get(w.rank) == w.pid, 5, "expected")
        node.post(_verdict(workers[0]))
        node.signal(signal.SIGTERM)
        node.post(_verdict(workers[1]))
        assert node.result() == ExitCode.PREEMPTED
    assert node.termination.killed == [workers[0].pid, workers[1].pid]
    assert sorted(e["rank"] for e in node.events("hang")) == [0, 1]
    assert len(node.spawner.workers) == 2  # no second cycle: the signal came first


def test_the_verdict_window_takes_what_arrives_before_its_deadline_and_keeps_the_rest() -> None:
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    first, late = _verdict(FakeWorker({"RANK": "0"})), _verdict(FakeWorker({"RANK": "1"}))
    inbox.put(first)
    inbox.put("a note")
    arrives = threading.Thread(target=inbox.put, args=(late,))  # while the window waits
    began = time.monotonic()
    arrives.start()
    taken = take_until(inbox, Verdict, began + 0.3)
    arrives.join(5)
    assert time.monotonic() - began >= 0.3  # the window is waited out, on the inbox
    assert taken == [first, late]
    inbox.put(_verdict(FakeWorker({"RANK": "2"})))
    inbox.put("after")
    # Past the deadline: only what is queued, without waiting; the rest stays in order.
    assert len(take_until(inbox, Verdict, deadline=0.0)) == 1
    assert [inbox.get_nowait(), inbox.get_nowait()] == ["a note", "after"] and inbox.empty()


def test_a_workload_shutdown_request_ends_the_job_without_relaunch(tmp_path: Path) -> None:
    with running_agent(tmp_path, ["--max-restarts=3"]) as node:
        workers = node.spawner.started(2)
        pid = workers[0].pid
        node.post(WorkloadControl(0, pid, pid, WorkloadAction.ShutdownWorkload, "done", 0.0))
        assert node.result() == ExitCode.DO_NOT_RELAUNCH
    assert [e["action"] for e in node.events("control_request")] == ["ShutdownWorkload"]
    assert "asked to shut the workload down" in node.events("exit")[0]["why"]
    # (end to end, through a real client and launchers: test_spares' exclude test)


def test_a_service_asking_to_stop_the_job_stops_it(tmp_path: Path) -> None:
    """The straggler detector's `--ft-straggler-action=stop`: a ServiceRequest on the inbox."""
    with running_agent(tmp_path, ["--max-restarts=3"]) as node:
        node.spawner.started(2)
        node.post(ServiceRequest("straggler detector", WorkloadAction.ShutdownWorkload, "slow"))
        assert node.result() == ExitCode.DO_NOT_RELAUNCH
    assert "shut the workload down" in node.events("exit")[0]["why"]
    # (end to end, the detector naming and excluding a slow node: test_straggler_launch)


def test_a_neighbour_lost_while_training_restarts_the_cycle(tmp_path: Path) -> None:
    """The neighbour watch's finding (its probes: test_neighbour_watch; over NCCL, where the
    survivors' collectives never fail: tests/gpu test_e): a failure that restarts the cycle."""
    with running_agent(tmp_path, ["--max-restarts=1"]) as node:
        node.spawner.started(2)
        node.post(NeighbourLost(0, "gone-node"))
        again = node.spawner.started(4)[2:]
        node.post(NeighbourLost(0, "gone-node"))  # cycle 0's, read in cycle 1: nothing
        for worker in again:
            worker.exit(0)
        assert node.result() == ExitCode.SUCCESS
        assert "gone-node stopped answering" in node.runtime.control.cause_of(0)
    assert len(node.termination.stops) == 1


def _verdict(worker: FakeWorker) -> Verdict:
    now = time.monotonic()
    return Verdict(rank=worker.rank, pid=worker.pid, worker_pid=worker.pid,
                   kind=HangKind.HEARTBEAT, section=None, timeout=1.0, waited=1.0,
                   deadline=now, detected_at=now, stack_file=None, stack="")  # fmt: skip
