"""The exit waiter (`agent.exits`) without processes: handles whose pid names no process (the
agent harness's fake workers) have no pidfd and are asked for their status. Each end is told
once, the waiter ends by itself once sealed, and `close` is bounded. With real processes, forked
and plain: tests/test_forkserver.py."""

from __future__ import annotations

import queue
import signal
import time

from agent_harness import FakeWorker
from ftrun.agent.exits import IDLE_S, ExitWaiter, open_pidfd


def test_each_end_is_told_once_and_the_waiter_ends_once_sealed() -> None:
    told: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
    first, second = FakeWorker({}), FakeWorker({})
    assert open_pidfd(first.pid) is None  # no process: asked, not waited on
    waiter = ExitWaiter("test-exits")
    waiter.watch(first, lambda code: told.put(("first", code)))
    waiter.watch(second, lambda code: told.put(("second", code)))
    waiter.seal()
    second.exit(3)
    assert told.get(timeout=5) == ("second", 3)
    first.exit(-signal.SIGKILL)
    assert told.get(timeout=5) == ("first", -signal.SIGKILL)
    assert waiter.close(5)  # it had ended by itself
    assert told.empty()


def test_close_is_bounded_when_a_worker_never_ends() -> None:
    told: queue.SimpleQueue[int] = queue.SimpleQueue()
    waiter = ExitWaiter("test-exits")
    waiter.watch(FakeWorker({}), told.put)  # runs forever
    began = time.monotonic()
    assert waiter.close(0.1)
    assert time.monotonic() - began < 0.1 + IDLE_S
    assert told.empty()
